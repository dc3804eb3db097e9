"""Safetensors checkpoint -> this rank's sharded parameters.

Each parameter's `weight_loader` narrows the full tensor to the rank's shard, so this is one loop
over the checkpoint; tensors are read lazily, one at a time, in the model's dtype."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


def load_weights(model: nn.Module, folder: Path, dtype: torch.dtype) -> None:
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
                param = params.get(target)
                if param is None:
                    continue
                tensor = f.get_tensor(name).to(dtype)
                getattr(param, "weight_loader", _copy)(param, tensor, shard)
                loaded.add(target)
                if target == "embed_tokens.weight" and model.tie_word_embeddings:
                    head = params["lm_head.weight"]
                    head.weight_loader(head, tensor, 0)
                    loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {folder} lacks {missing[:5]}{'...' if len(missing) > 5 else ''}")


def _copy(param: nn.Parameter, tensor: torch.Tensor, shard: int = 0) -> None:
    param.data.copy_(tensor)
