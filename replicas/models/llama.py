"""The Llama family (Llama, Mistral, Qwen2, Qwen3) on tensor-parallel layers and the paged cache.

Qwen2 adds biases to q/k/v; Qwen3 adds per-head RMSNorm on q and k. The forward takes the flat
tokens of one step (all rows concatenated) and returns hidden states; `compute_logits` runs the
head only on the positions the runner asks for."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from replicas.attention import AttentionMetadata, paged_attention
from replicas.models.parallel import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                      VocabParallelEmbedding, tp_size)
from replicas.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        tp = tp_size()
        self.head_dim = _head_dim(config)
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = config.num_key_value_heads // tp
        if config.num_key_value_heads % tp or config.num_attention_heads % tp:
            raise ValueError("attention heads must divide evenly across tensor-parallel ranks")
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q_size, kv_size, kv_size], bias)
        self.o_proj = RowParallelLinear(q_size, config.hidden_size,
                                        bias=bool(getattr(config, "attention_bias", False)))
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rope = rope
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_len, kv_len = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_len, kv_len, kv_len], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [inter, inter])
        self.down_proj = RowParallelLinear(inter, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(config, rope)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        rope = RotaryEmbedding(config, _head_dim(config))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, rope)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """kv_cache: [layers, 2, kv_heads, slots, head_dim]."""
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, kv_cache[i, 0], kv_cache[i, 1], meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def checkpoint_name(self, name: str) -> tuple[str, int]:
        """Maps an HF checkpoint tensor name to (our parameter name, shard index)."""
        name = name.removeprefix("model.")
        for fragment, (fused, shard) in self.packed_modules.items():
            if f".{fragment}." in name:
                return name.replace(fragment, fused), shard
        return name, 0
