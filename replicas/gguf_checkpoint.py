"""GGUF checkpoints (llama.cpp's one-file format): the folder the rest of shardserve reads, and the
tensors.

`gguf_folder(file)` turns a .gguf file into a cached folder holding what a Hugging Face checkpoint
holds besides its weights: config.json and the tokenizer files (transformers' conversion of the
GGUF metadata: vocabulary, merges, special tokens, chat template), plus `model.gguf`, a link to
the file. The ingress's tokenizer and template code and the engine's config reading then treat it
as any folder; `loader.load_weights` reads the weights through the link with `read_tensors`
(over `gguf_reader.GGUFFile`, not gguf-py's slower reader), which names each tensor as Hugging
Face does and undoes the Q/K row permutation llama.cpp's converter applies to Llama-architecture
checkpoints.

Every tensor type is read: Q4_0, Q4_1 and Q8_0 stay in their blocks for the native kernels
(`quant.py`), Q4_K is repacked into Q4_1 blocks and Q6_K into 6-bit Q6 blocks
(`quant.REPACKED`); F32, F16 and BF16 are floats; other block types (Q5_K, I-quants) are
dequantized by gguf-py at load, to be served in float or re-quantized to Q8_0 by the loader."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from replicas import quant
from replicas.gguf_reader import GGUFFile

LINK = "model.gguf"
BUILDER_VERSION = 1
# GGUF architecture -> (HF architecture, whether the converter permuted q/k rows)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}


class GGUFError(ValueError):
    """A GGUF file shardserve cannot serve: broken, truncated, or of an unsupported kind."""


def _reader(file: Path) -> GGUFFile:
    try:
        return GGUFFile(file)
    except Exception as exc:  # ValueError, struct.error on a short header, OSError
        raise GGUFError(f"{file}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def _architecture(reader: GGUFFile, file: Path) -> str:
    """The file's GGUF architecture, checked against those shardserve's model code has."""
    arch = reader.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{file}: GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")
    return arch


def _key(file: Path) -> str:
    stat = file.stat()
    text = f"{BUILDER_VERSION}|{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def gguf_folder(file: Path, cache_dir: Path, extra: dict[str, str] | None = None) -> Path:
    """The cached folder for `file` (built on first use, published atomically, as the embedded
    models are; a cached one is found without reading the file). `extra`: more files to write
    into it (name -> text), e.g. a generation config."""
    file = file.expanduser().resolve()
    if not file.is_file():
        raise GGUFError(f"{file}: no such GGUF file")
    digest = hashlib.sha256(_key(file).encode())
    for name, text in sorted((extra or {}).items()):
        digest.update(f"{name}\0{text}".encode())
    final = cache_dir / "gguf" / f"{file.stem}-{digest.hexdigest()[:12]}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        _write_folder(file, staging, _architecture(_reader(file), file))
        for name, text in (extra or {}).items():
            (staging / name).write_text(text)
        staging.chmod(0o755)
        try:
            os.rename(staging, final)
        except OSError:  # another process published it first; theirs is identical
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _write_folder(file: Path, folder: Path, arch: str) -> None:
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name)
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as exc:
        raise GGUFError(f"{file}: its metadata does not convert to a config and tokenizer "
                        f"({type(exc).__name__}: {exc})") from exc
    config.architectures = [ARCHITECTURES[arch][0]]
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    os.symlink(file, folder / LINK)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor under its Hugging Face name: `raw` holds GGUF's rows as stored ([rows, row
    bytes] uint8 for block formats, else floats [rows, cols]); `fmt` is its native block format
    or None (then `raw` is float)."""

    name: str
    raw: torch.Tensor
    fmt: quant.BlockFormat | None
    dequantized: bool = False  # a block type without a native kernel, read as floats

    def to_float(self) -> torch.Tensor:
        return self.raw.float() if self.fmt is None else quant.dequantize(self.raw, self.fmt)


def hf_name(name: str) -> str:
    """GGUF tensor name -> Hugging Face's; a GGUFError for a tensor the Llama family lacks."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise GGUFError(f"GGUF tensor {name!r} has no place in the Llama-family model code")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undoes llama.cpp's converter's q/k permutation of rows (it interleaves each head's two
    rotary halves); blocks lie along a row, so quantized rows move whole."""
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]) \
        .transpose(1, 2).reshape(rows.shape)


def read_tensors(file: Path, heads: int, kv_heads: int) -> Iterator[GGUFTensor]:
    """Every tensor of `file` (rope frequency tables aside: our rotary code computes them)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader = _reader(file)
    permuted = ARCHITECTURES[_architecture(reader, file)][1]
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        name = hf_name(t.name)
        kind, data = t.tensor_type, np.asarray(t.data)  # uint8 rows, as stored
        fmt, dequantized = quant.NATIVE.get(kind), False
        if fmt is not None or kind in quant.REPACKED:
            raw = torch.from_numpy(data.copy()).view(torch.uint8).reshape(data.shape[0], -1)
            if fmt is None:
                repack, fmt = quant.REPACKED[kind]
                raw = repack(raw)
        elif kind in _FLOAT_TYPES:
            raw = torch.from_numpy(data.copy()).view(_FLOAT_TYPES[kind])
        else:
            try:
                raw = torch.from_numpy(dequantize(data, GGMLQuantizationType(kind)).copy())
                dequantized = True
            except Exception as exc:  # an enum value gguf-py lacks, or one it cannot dequantize
                raise GGUFError(f"{file}: tensor {t.name} has GGML type {kind}, which cannot "
                                f"be read ({type(exc).__name__}: {exc})") from exc
        if raw.dim() == 1 and not name.endswith(("norm.weight", ".bias")):
            raise GGUFError(f"{file}: tensor {t.name} should be 2-d")
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            raw = _unpermute(raw, heads if ".q_proj." in name else kv_heads)
        yield GGUFTensor(name, raw, fmt, dequantized)
