"""The model's sampling defaults (--generation-config): a request that leaves a field out gets the
model's value in the engine's SamplingParams, one that sets it keeps its own; `vllm` reads no file;
the embedded default model ships the defaults the README explains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from replicas.embedded import DEFAULT_MODEL_ID
from replicas.model_files import resolve_model_path
from serve_app.generation_defaults import SamplingDefaults, load
from serve_app.protocol import ChatCompletionRequest
from serve_app.sampling import ServerLimits, build


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 100 for c in text]


def _params(defaults: SamplingDefaults, **fields: Any):
    limits = ServerLimits(max_model_len=1024, vocab_size=100, max_n=4, priority_scheduling=False,
                          logits_processors=frozenset(), defaults=defaults)
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields})
    return build(request, prompt_len=5, limits=limits, tokenizer=_Tokenizer(), chat=True)[0]


def _folder(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_omitted_fields_take_the_models_defaults(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"do_sample": True, "temperature": 0.2, "top_p": 0.9, "top_k": 40,
                                "min_p": 0.05, "repetition_penalty": 1.1, "eos_token_id": 2})
    defaults = load("auto", folder)
    assert defaults == SamplingDefaults(0.2, 0.9, 40, 0.05, 1.1)
    p = _params(defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        0.2, 0.9, 40, 0.05, 1.1)
    own = _params(defaults, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0,
                  repetition_penalty=1.0)
    assert (own.temperature, own.top_p, own.top_k, own.min_p, own.repetition_penalty) == (
        0.0, 1.0, 0, 0.0, 1.0)
    assert _params(defaults, temperature=0.7).top_p == 0.9  # field by field


def test_vllm_and_missing_files_mean_openais_defaults(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"temperature": 0.2})
    assert load("vllm", folder) == SamplingDefaults()
    assert load("auto", tmp_path / "elsewhere") == SamplingDefaults()
    p = _params(SamplingDefaults())
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        1.0, 1.0, 0, 0.0, 1.0)
    with pytest.raises(ValueError, match="no generation_config.json"):
        load(str(tmp_path / "elsewhere"), folder)
    assert load(str(folder), tmp_path / "elsewhere").temperature == 0.2  # a FOLDER


def test_greedy_files_and_bad_values(tmp_path: Path) -> None:
    # transformers' greedy configs carry sampling fields they never use
    greedy = _folder(tmp_path, {"do_sample": False, "temperature": 0.6, "top_p": 0.9,
                                "repetition_penalty": 1.05})
    assert load("auto", greedy) == SamplingDefaults(repetition_penalty=1.05)
    _folder(tmp_path, {"temperature": 5.0})
    with pytest.raises(ValueError, match="temperature out of range"):
        load("auto", tmp_path)


def test_a_prediction_gets_no_default_penalty(tmp_path: Path) -> None:
    p = _params(SamplingDefaults(temperature=0.2, repetition_penalty=1.1),
                prediction={"type": "content", "content": "hello"})
    assert p.repetition_penalty == 1.0 and p.temperature == 0.2


def test_the_default_model_serves_with_its_defaults() -> None:
    folder = resolve_model_path(DEFAULT_MODEL_ID)
    assert load("auto", folder) == SamplingDefaults(temperature=0.2, top_p=0.9,
                                                    repetition_penalty=1.1)
