"""Rotary position embeddings, with HF's rope_type variants (llama3, linear, yarn, ...) taken from
transformers' own parameter functions so scaled-RoPE checkpoints load correctly."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig


def _rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(params)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        params = _rope_parameters(config)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        max_pos = int(getattr(config, "max_position_embeddings", 4096))
        t = torch.arange(max_pos, dtype=torch.float)
        freqs = torch.outer(t, inv_freq.float())
        # kept in float32 whatever the model's dtype (module.to(dtype) would round them)
        self.cos = freqs.cos() * scaling
        self.sin = freqs.sin() * scaling

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D/2] cos and sin of the step's positions, once per step for every layer."""
        if self.cos.device != positions.device:
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        # computed in float32 and applied in the model's dtype, as transformers does
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] -> rotated copy. HF's rotate_half convention: the two halves of the head dim
    form the pairs."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
