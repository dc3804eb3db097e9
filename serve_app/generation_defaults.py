"""The model's own sampling defaults (vLLM's `--generation-config auto|vllm|FOLDER`).

`auto` reads the served model folder's `generation_config.json`, a FOLDER path reads that
folder's, `vllm` reads none. The fields a request leaves out (temperature, top_p, top_k, min_p,
repetition_penalty) take the file's values; a request's own values always win; without a value
from either, the OpenAI defaults apply (temperature 1, no truncation, no penalty)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def items(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


def load(setting: str, model_folder: Path) -> SamplingDefaults:
    """The defaults `setting` ("auto", "vllm" or a folder) names; a ValueError for a folder
    without a readable generation_config.json or a value out of range."""
    if setting == "vllm":
        return SamplingDefaults()
    explicit = setting != "auto"
    file = (Path(setting).expanduser() if explicit else model_folder) / "generation_config.json"
    if not file.exists():
        if explicit:
            raise ValueError(f"--generation-config {setting}: no generation_config.json there")
        return SamplingDefaults()
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file}: not readable JSON ({exc})") from exc
    # transformers writes do_sample=false with sampling fields it would not use: greedy there
    values = {f.name: data[f.name] for f in fields(SamplingDefaults)
              if isinstance(data.get(f.name), (int, float)) and not isinstance(data[f.name], bool)}
    if data.get("do_sample") is False:
        values = {k: v for k, v in values.items() if k == "repetition_penalty"}
    defaults = SamplingDefaults(**values)
    _check(defaults, file)
    return defaults


def _check(d: SamplingDefaults, file: Path) -> None:
    bad = [name for name, ok in (
        ("temperature", d.temperature is None or 0 <= d.temperature <= 2),
        ("top_p", d.top_p is None or 0 < d.top_p <= 1),
        ("top_k", d.top_k is None or d.top_k >= -1),
        ("min_p", d.min_p is None or 0 <= d.min_p <= 1),
        ("repetition_penalty", d.repetition_penalty is None or d.repetition_penalty > 0)) if not ok]
    if bad:
        raise ValueError(f"{file}: {', '.join(bad)} out of range")
