"""Turns a served model name into a local folder of Hugging Face checkpoint files.

Owns the ways a model can be named: an embedded id (`shardserve/smollm2-135m-instruct`,
`shardserve/tiny-llama`, ..., see replicas.embedded), a local directory, a GGUF file (or a
directory whose only weights are one), each turned into a folder by `gguf_checkpoint`, or a
Hugging Face hub id (downloaded into the hub cache, weights and tokenizer files only)."""

from __future__ import annotations

from pathlib import Path

from replicas.embedded import EMBEDDED_MODELS, default_cache_dir
from replicas.gguf_checkpoint import gguf_folder

# Enough to load config, weights, tokenizer and chat template; skips .bin/.pt/.gguf/.onnx duplicates.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve_model_path(model: str) -> Path:
    """Returns a local folder holding `model`'s files; raises ValueError when it cannot."""
    build = EMBEDDED_MODELS.get(model)
    if build is not None:
        return build()
    local = Path(model).expanduser()
    if local.is_file() and local.suffix == ".gguf":
        return gguf_folder(local, default_cache_dir())
    if local.is_dir():
        ggufs = sorted(local.glob("*.gguf"))
        if len(ggufs) == 1 and not any(local.glob("*.safetensors")):
            return gguf_folder(ggufs[0], default_cache_dir())
        return local
    if model.startswith((".", "/", "~")) or local.exists():
        # A path-like name must not fall through to the hub as a bogus repo id.
        raise ValueError(f"cannot load model {model!r}: not a directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as exc:  # offline, unknown repo, gated, bad id: all mean "cannot serve this"
        raise ValueError(f"cannot load model {model!r}: {type(exc).__name__}: {exc}") from exc
