"""Turns a served model name into a local folder of Hugging Face checkpoint files.

Owns the three ways a model can be named: an embedded id (`shardserve/tiny-llama`,
`shardserve/bench-135m`, built locally on first use), a local directory, or a Hugging Face hub id
(downloaded into the hub cache, weights and tokenizer files only)."""

from __future__ import annotations

from pathlib import Path

from replicas.embedded import EMBEDDED_MODELS

# Enough to load config, weights, tokenizer and chat template; skips .bin/.pt/.gguf/.onnx duplicates.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve_model_path(model: str) -> Path:
    """Returns a local folder holding `model`'s files; raises ValueError when it cannot."""
    build = EMBEDDED_MODELS.get(model)
    if build is not None:
        return build()
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    if model.startswith((".", "/", "~")) or local.exists():
        # A path-like name must not fall through to the hub as a bogus repo id.
        raise ValueError(f"cannot load model {model!r}: not a directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as exc:  # offline, unknown repo, gated, bad id: all mean "cannot serve this"
        raise ValueError(f"cannot load model {model!r}: {type(exc).__name__}: {exc}") from exc
