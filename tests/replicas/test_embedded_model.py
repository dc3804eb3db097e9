"""The embedded model: shipped tokenizer, chat template, deterministic weights, model-path resolution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from replicas.embedded import (
    BENCH_MODEL_ID,
    EMBEDDED_MODEL_ID,
    EMBEDDED_MODELS,
    PACKAGE_DIR,
    TINY_LLAVA_MODEL_ID,
    TINY_QWEN2_5_VL_MODEL_ID,
    TINY_QWEN2_AUDIO_MODEL_ID,
    ensure_embedded_model,
    ensure_tiny_llava,
    ensure_tiny_qwen2_5_vl,
    ensure_tiny_qwen2_audio,
)
from replicas.model_files import resolve_model_path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]


@pytest.fixture(scope="module")
def raw_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(PACKAGE_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_embedded_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def test_shipped_files_are_small() -> None:
    assert (PACKAGE_DIR / "tokenizer.json").stat().st_size < 1_000_000
    config = json.loads((PACKAGE_DIR / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (PACKAGE_DIR / "chat_template.jinja").read_text()
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None and config["add_bos_token"] is False


@pytest.mark.parametrize("text", [
    "Hello, world! The quick brown fox.",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "Ça va très bien, garçon. Über Straße, mañana, São Paulo.",
    "日本語のテキスト, 你好世界, 안녕하세요",
    "emoji 😀🚀 👩‍💻 🇯🇵 ❤️",
    'def f(x):\n    return {"a": [1, 2.5, None]}\n',
    "e\u0301 (combining accent stays as typed)",
])
def test_round_trip(raw_tokenizer: Tokenizer, text: str) -> None:
    ids = raw_tokenizer.encode(text).ids
    assert raw_tokenizer.decode(ids) == text


def test_no_bos_or_eos_added(raw_tokenizer: Tokenizer) -> None:
    added = {raw_tokenizer.token_to_id(token) for token in SPECIALS}
    assert not added & set(raw_tokenizer.encode("hi there").ids)


@pytest.mark.parametrize("token", SPECIALS + MARKUP)
def test_added_tokens_are_single(raw_tokenizer: Tokenizer, token: str) -> None:
    ids = raw_tokenizer.encode(f"a{token}b").ids
    assert raw_tokenizer.token_to_id(token) in ids
    assert len(raw_tokenizer.encode(token).ids) == 1


def test_skip_special_tokens_keeps_markup(hf_tokenizer) -> None:
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = hf_tokenizer(text)["input_ids"]
    assert hf_tokenizer.decode(ids) == text
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == (
        "assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call>")


def test_hf_tokenizer_settings(hf_tokenizer) -> None:
    assert hf_tokenizer.eos_token == "<|im_end|>"
    assert hf_tokenizer.pad_token == "<|endoftext|>"
    assert hf_tokenizer.bos_token is None
    assert hf_tokenizer.model_max_length == 4096
    assert hf_tokenizer("hello")["input_ids"] == hf_tokenizer.encode("hello", add_special_tokens=False)


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_template_basic_turns(hf_tokenizer) -> None:
    text = render(hf_tokenizer, [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
    ], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\none\ntwo<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_template_developer_and_no_generation_prompt(hf_tokenizer) -> None:
    text = render(hf_tokenizer, [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "x"}])
    assert text == "<|im_start|>system\nRules.<|im_end|>\n<|im_start|>user\nx<|im_end|>\n"


def test_template_thinking_switch(hf_tokenizer) -> None:
    messages = [{"role": "user", "content": "q"}]
    assert render(hf_tokenizer, messages, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    off = render(hf_tokenizer, messages, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_tools_calls_and_results(hf_tokenizer) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "system", "content": "Sys."},
        {"role": "user", "content": "Weather in Paris and time?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need two tools.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}},
        ]},
        {"role": "tool", "tool_call_id": "a", "content": "20C"},
        {"role": "tool", "tool_call_id": "b", "content": "12:00"},
        {"role": "assistant", "content": "20C at noon.", "reasoning": "easy"},
    ]
    text = render(hf_tokenizer, messages, tools=tools, reasoning_effort="low")
    assert text.startswith("<|im_start|>system\nSys.\n\nReasoning effort: low\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert ('\n</tools>\n\nFor each function call, return a json object with function name and arguments '
            'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
            '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n') in text
    assert ("<|im_start|>assistant\n<think>\nNeed two tools.\n</think>\n\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call><|im_end|>\n') in text
    assert ("<|im_start|>user\n<tool_response>\n20C\n</tool_response>\n"
            "<tool_response>\n12:00\n</tool_response><|im_end|>\n") in text
    assert text.endswith("<|im_start|>assistant\n<think>\neasy\n</think>\n\n20C at noon.<|im_end|>\n")


def test_template_renders_media_parts_as_their_placeholders(hf_tokenizer) -> None:
    text = render(hf_tokenizer, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image"},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},
        {"type": "audio"},
        {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
        {"type": "text", "text": "Same?"}]}])
    audio = "<|audio_bos|><|AUDIO|><|audio_eos|>"
    assert text == (f"<|im_start|>user\n<image>\n<image>\n{audio}\n{audio}\n{audio}\n<video>\n"
                    "Same?<|im_end|>\n")


def test_template_documents(hf_tokenizer) -> None:
    text = render(hf_tokenizer, [{"role": "user", "content": "q"}],
                  documents=[{"title": "Paris", "text": "Paris is in France."}])
    assert text.startswith(
        "<|im_start|>system\n# Documents\n\nUse the following documents to answer the user's query:\n"
        '<documents>\n<document index="1">\nTitle: Paris\nParis is in France.\n</document>\n</documents>'
        "<|im_end|>\n<|im_start|>user\nq<|im_end|>\n")


def test_ensure_is_cached_and_deterministic(model_dir: Path, tmp_path: Path) -> None:
    assert ensure_embedded_model(model_dir.parent) == model_dir
    assert model_dir.name.startswith("tiny-llama-")
    assert sorted(p.name for p in model_dir.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")]  # no staging left over
    rebuilt = ensure_embedded_model(tmp_path)
    assert rebuilt.name == model_dir.name
    assert (rebuilt / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_model_files(model_dir: Path, hf_tokenizer) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] % 64 == 0 and config["vocab_size"] >= len(hf_tokenizer)
    assert config["bos_token_id"] is None
    assert config["eos_token_id"] == hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == hf_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])


def test_model_loads_and_generates_varied_tokens(model_dir: Path, hf_tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    assert model.dtype == torch.float32
    assert 4_500_000 < sum(p.numel() for p in model.parameters()) < 5_500_000
    ids = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello, how are you?"}], add_generation_prompt=True, return_dict=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    assert len(set(out)) > 8  # random weights, but the output must not collapse to one repeated token


def test_resolve_model_path(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model_path(str(model_dir)) == model_dir
    monkeypatch.setenv("SHARDSERVE_CACHE", str(model_dir.parent))
    assert resolve_model_path(EMBEDDED_MODEL_ID) == model_dir


def test_resolve_model_path_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="cannot load model './missing'"):
        resolve_model_path("./missing")
    with pytest.raises(ValueError, match="cannot load model 'nobody/no-such-model-xyz'"):
        resolve_model_path("nobody/no-such-model-xyz")


def test_bench_model_is_registered() -> None:
    from replicas.embedded import BENCH_135M, EMBEDDED_MODELS

    assert BENCH_MODEL_ID in EMBEDDED_MODELS  # built only on demand: ~110M parameters
    assert BENCH_135M["dtype"] == "bfloat16" and BENCH_135M["num_hidden_layers"] == 30


def built_twice(ensure, prefix: str, files: list[str], same: tuple[str, ...],
                tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`ensure` builds a folder named `prefix`-<key> of exactly `files`, found again in its cache,
    and a build into another cache gives the same name and the same bytes of `same`."""
    first = ensure(tmp_path_factory.mktemp("cache"))
    assert first.name.startswith(prefix) and ensure(first.parent) == first
    assert sorted(p.name for p in first.iterdir()) == files
    rebuilt = ensure(tmp_path_factory.mktemp("cache"))
    assert rebuilt.name == first.name
    for name in same:
        assert (rebuilt / name).read_bytes() == (first / name).read_bytes()
    return first


WEIGHTS_AND_TOKENIZER = ("model.safetensors", "tokenizer.json", "tokenizer_config.json")


def test_tiny_llava_is_cached_deterministic_and_loads_offline(tmp_path_factory) -> None:
    from transformers import AutoProcessor, LlavaProcessor

    assert EMBEDDED_MODELS[TINY_LLAVA_MODEL_ID] is ensure_tiny_llava
    first = built_twice(ensure_tiny_llava, "tiny-llava-", [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "preprocessor_config.json", "processor_config.json", "tokenizer.json",
        "tokenizer_config.json"], WEIGHTS_AND_TOKENIZER, tmp_path_factory)
    config = json.loads((first / "config.json").read_text())
    processor = AutoProcessor.from_pretrained(first, local_files_only=True)
    assert isinstance(processor, LlavaProcessor)
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert config["image_token_index"] == image_id == processor.image_token_id
    assert config["text_config"]["vocab_size"] % 64 == 0
    assert config["text_config"]["vocab_size"] > image_id == len(processor.tokenizer) - 1
    ids = processor.tokenizer("a<image>b")["input_ids"]
    assert processor.tokenizer.decode(ids, skip_special_tokens=True) == "ab"


def test_tiny_qwen2_audio_is_cached_deterministic_and_loads_offline(tmp_path_factory) -> None:
    import numpy as np
    from transformers import AutoProcessor, Qwen2AudioProcessor, WhisperFeatureExtractor

    assert EMBEDDED_MODELS[TINY_QWEN2_AUDIO_MODEL_ID] is ensure_tiny_qwen2_audio
    first = built_twice(ensure_tiny_qwen2_audio, "tiny-qwen2-audio-", [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "preprocessor_config.json", "processor_config.json", "tokenizer.json",
        "tokenizer_config.json"], WEIGHTS_AND_TOKENIZER, tmp_path_factory)
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["Qwen2AudioForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "qwen2"
    assert config["audio_config"]["num_mel_bins"] == 128
    processor = AutoProcessor.from_pretrained(first, local_files_only=True)
    assert isinstance(processor, Qwen2AudioProcessor)
    tokenizer = processor.tokenizer
    audio_id = tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    assert processor.audio_token == "<|AUDIO|>"
    assert config["audio_token_index"] == audio_id == processor.audio_token_id
    assert tokenizer.convert_tokens_to_ids(["<|audio_bos|>", "<|audio_eos|>"]) == [
        audio_id + 1, audio_id + 2]
    assert config["text_config"]["vocab_size"] % 64 == 0
    assert config["text_config"]["vocab_size"] > audio_id + 2 == len(tokenizer) - 1
    ids = tokenizer("a<|audio_bos|><|AUDIO|><|audio_eos|>b")["input_ids"]
    assert len(ids) == 5 and tokenizer.decode(ids, skip_special_tokens=True) == "ab"
    extractor = processor.feature_extractor
    assert isinstance(extractor, WhisperFeatureExtractor)
    assert (extractor.feature_size, extractor.sampling_rate, extractor.chunk_length,
            extractor.n_fft, extractor.hop_length, extractor.nb_max_frames) == (
        128, 16000, 30, 400, 160, 3000)
    # the processor expands the template's one <|AUDIO|> into the audio's count: 1 s, 100 frames
    chat = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "input_audio"}, {"type": "text", "text": "?"}]}],
        add_generation_prompt=True, tokenize=False)
    assert "<|audio_bos|><|AUDIO|><|audio_eos|>\n?" in chat
    out = processor(text=chat, audio=[np.zeros(16000, dtype=np.float32)], sampling_rate=16000,
                    return_tensors="np")
    assert out["input_features"].shape == (1, 128, 3000)
    assert out["feature_attention_mask"].sum() == 100
    assert (out["input_ids"][0] == audio_id).sum() == 25


def test_tiny_qwen2_5_vl_is_cached_deterministic_and_loads_offline(tmp_path_factory) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer

    assert EMBEDDED_MODELS[TINY_QWEN2_5_VL_MODEL_ID] is ensure_tiny_qwen2_5_vl
    first = built_twice(ensure_tiny_qwen2_5_vl, "tiny-qwen2.5-vl-", [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"],
        (*WEIGHTS_AND_TOKENIZER, "chat_template.jinja"), tmp_path_factory)
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    text, vision = config["text_config"], config["vision_config"]
    assert text["model_type"] == "qwen2_5_vl_text"
    assert text["rope_parameters"]["mrope_section"] == [4, 6, 6]  # head_dim 32: 16 pairs
    assert text["hidden_size"] // text["num_attention_heads"] == 32
    assert vision["out_hidden_size"] == text["hidden_size"]
    assert (vision["window_size"], vision["fullatt_block_indexes"]) == (56, [1, 3])
    tokenizer = AutoTokenizer.from_pretrained(first, local_files_only=True)
    start, end, image, video = tokenizer.convert_tokens_to_ids(
        ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    assert [start, end, image, video] == list(range(start, start + 4))
    assert (config["vision_start_token_id"], config["vision_end_token_id"],
            config["image_token_id"], config["video_token_id"]) == (start, end, image, video)
    assert text["vocab_size"] % 64 == 0 and text["vocab_size"] > video == len(tokenizer) - 1
    ids = tokenizer("a<|vision_start|><|image_pad|><|vision_end|>b")["input_ids"]
    assert len(ids) == 5 and tokenizer.decode(ids, skip_special_tokens=True) == "ab"
    # the shared template with image parts rendered as Qwen2.5-VL's
    shared = (PACKAGE_DIR / "chat_template.jinja").read_text()
    template = (first / "chat_template.jinja").read_text()
    assert json.loads((first / "tokenizer_config.json").read_text())["chat_template"] == template
    vl_image = "<|vision_start|><|image_pad|><|vision_end|>"
    vl_video = "<|vision_start|><|video_pad|><|vision_end|>"
    assert template == shared.replace("['<image>']", f"['{vl_image}']").replace(
        "['<video>']", f"['{vl_video}']") != shared
    chat = render(tokenizer, [{"role": "user", "content": [
        {"type": "text", "text": "Two:"}, {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "image"}, {"type": "text", "text": "Same?"}]}], add_generation_prompt=True)
    assert chat == (f"<|im_start|>user\nTwo:\n{vl_image}\n{vl_image}\nSame?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    processor = AutoImageProcessor.from_pretrained(first, local_files_only=True)
    assert type(processor).__name__.startswith("Qwen2VLImageProcessor")
    assert (processor.size["shortest_edge"], processor.size["longest_edge"]) == (56 * 56, 112 * 112)
    assert (processor.patch_size, processor.temporal_patch_size, processor.merge_size) == (14, 2, 2)
