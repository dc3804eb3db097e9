"""Checkpoint -> this rank's parameters: safetensors folders, and GGUF files (through the folder
`gguf_checkpoint` makes for them).

Each parameter's `weight_loader` narrows the full tensor to the rank's shard, so this is one loop
over the checkpoint; tensors are read lazily, one at a time, in the model's dtype. A GGUF file's
block-quantized linears and embedding stay quantized where the native kernels multiply them
(`keep_quantized`: a CPU, one rank, float32 compute): fused projections' parts are concatenated
row-wise and packed (`quant.pack`), block types without a native kernel are re-quantized to Q8_0;
a tied embedding gathers its rows from the head's packed panels (one copy of the table).
Elsewhere every tensor is dequantized to the model's dtype as it is read. `quantize_int8` turns
a float checkpoint's linears into Q8_0 after loading (`--quantization int8`)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from replicas import kernels, quant
from replicas.gguf_checkpoint import LINK, GGUFError, read_tensors
from replicas.models.parallel import LINEARS, VocabParallelEmbedding


def load_weights(model: nn.Module, folder: Path, dtype: torch.dtype,
                 keep_quantized: bool = False) -> None:
    if (folder / LINK).exists():
        if getattr(model, "modalities", None):
            raise GGUFError(f"{folder}: GGUF checkpoints of multimodal models are not supported; "
                            "serve the model's safetensors folder")
        _load_gguf(model, folder / LINK, dtype, keep_quantized)
        return
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder}")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                target, shard = model.checkpoint_name(name)
                if target in params:
                    _assign(model, params, loaded, target, f.get_tensor(name).to(dtype), shard)
    _check_complete(params, loaded, folder)


def _assign(model: nn.Module, params: dict[str, nn.Parameter], loaded: set[str], target: str,
            tensor: torch.Tensor, shard: int) -> None:
    param = params[target]
    getattr(param, "weight_loader", _copy)(param, tensor, shard)
    loaded.add(target)
    # "embed_tokens.weight", or a decoder's inside a multimodal model
    if target.endswith("embed_tokens.weight") and model.tie_word_embeddings:
        head_name = target.removesuffix("embed_tokens.weight") + "lm_head.weight"
        head = params[head_name]
        head.weight_loader(head, tensor, 0)
        loaded.add(head_name)


def _check_complete(params: dict[str, nn.Parameter], loaded: set[str], source: Path) -> None:
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {source} lacks "
                         f"{missing[:5]}{'...' if len(missing) > 5 else ''}")


def _copy(param: nn.Parameter, tensor: torch.Tensor, shard: int = 0) -> None:
    param.data.copy_(tensor)


def _load_gguf(model: nn.Module, file: Path, dtype: torch.dtype, keep_quantized: bool) -> None:
    config = model.config
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    # module name -> shard -> (raw rows, format): quantized parts, packed once all are read
    pending: dict[str, dict[int, tuple[torch.Tensor, quant.BlockFormat]]] = {}
    for t in read_tensors(file, config.num_attention_heads, config.num_key_value_heads):
        target, shard = model.checkpoint_name(t.name.removeprefix("model."))
        if target not in params:
            raise GGUFError(f"{file}: tensor {t.name} has no parameter in the model")
        module_name, _, leaf = target.rpartition(".")
        module = model.get_submodule(module_name)
        quantized = t.fmt is not None or t.dequantized
        if keep_quantized and quantized and leaf == "weight" and isinstance(
                module, (*LINEARS, VocabParallelEmbedding)):
            raw, fmt = (t.raw, t.fmt) if t.fmt is not None else (
                quant.quantize_q8_0(t.raw), quant.Q8_0)
            tied = target == "embed_tokens.weight" and model.tie_word_embeddings
            # a tied head's packed panels serve the embedding's gathers too: one copy
            pending.setdefault("lm_head" if tied else module_name, {})[shard] = (raw, fmt)
            loaded.add(target)
            if tied:
                loaded.add("lm_head.weight")
            continue
        _assign(model, params, loaded, target, t.to_float().to(dtype), shard)
    _check_complete(params, loaded, file)
    for module_name, shards in pending.items():
        _set_quantized(model.get_submodule(module_name), [shards[i] for i in sorted(shards)])
    if model.tie_word_embeddings and model.lm_head.quant_format is not None:
        model.embed_tokens.weight = model.lm_head.weight
        model.embed_tokens.quant_format = model.lm_head.quant_format


def quantize_int8(model: nn.Module) -> int:
    """`--quantization int8`: every linear and embedding whose weight is still float (and whose
    input features are whole 32-weight blocks) becomes Q8_0: weight-only int8 with a float16
    scale per 32 weights (finer than per-channel scales, 8.5 bits a weight). Returns how many."""
    done = 0
    for module in model.modules():
        if not isinstance(module, (*LINEARS, VocabParallelEmbedding)):
            continue
        weight = module.weight
        if weight.dtype == torch.uint8 or weight.dim() != 2 or weight.shape[1] % quant.BLOCK:
            continue
        _set_quantized(module, [(quant.quantize_q8_0(weight.data), quant.Q8_0)])
        done += 1
    return done


def _set_quantized(module: nn.Module,
                   parts: list[tuple[torch.Tensor, quant.BlockFormat]]) -> None:
    """Gives `module` its block-quantized weight: an embedding keeps GGUF's rows (gathered and
    dequantized per step), a linear the packed panels of its parts' rows. Parts of different
    formats (a K-quant mix's q and v) are re-quantized to Q8_0 together."""
    formats = {fmt for _, fmt in parts}
    if len(formats) > 1:
        parts = [(quant.quantize_q8_0(quant.dequantize(raw, fmt)), quant.Q8_0)
                 for raw, fmt in parts]
    fmt = parts[0][1]
    raw = torch.cat([r for r, _ in parts]) if len(parts) > 1 else parts[0][0]
    if isinstance(module, VocabParallelEmbedding) and not isinstance(module, LINEARS):
        module.weight = nn.Parameter(raw.contiguous(), requires_grad=False)
        module.quant_format = fmt
        return
    module.weight = nn.Parameter(quant.pack(raw, fmt, kernels.float32_panel()),
                                 requires_grad=False)
    module.quant_format = fmt
