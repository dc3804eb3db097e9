"""The Llama family (Llama, Mistral, Qwen2, Qwen3) on tensor-parallel layers and the paged cache.

Qwen2 adds biases to q/k/v; Qwen3 adds per-head RMSNorm on q and k. The forward takes the flat
tokens of one step (all rows concatenated) and returns hidden states; `compute_logits` runs the
head only on the positions the runner asks for. It is also the decoder of `llava.py`, whose image
rows reach it as `embeds`."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from replicas import kernels
from replicas.attention import AttentionMetadata, paged_attention
from replicas.models.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    tp_size,
)
from replicas.models.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.supports(x.dtype, x.device):
            return kernels.add_rms_norm(x, None, self.weight, self.eps)
        # normalised in float32, scaled in the model's dtype, as transformers does
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm of x + residual, x + residual); the sum may be written into `residual`."""
        if kernels.supports(x.dtype, x.device):
            return kernels.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = x + residual
        return self(residual), residual


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
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
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = qkv.view(-1, heads + 2 * kv_heads, dim)
        stored = not self.qk_norm and kernels.supports_cache(qkv.dtype, k_cache.dtype,
                                                             qkv.device)
        if stored:
            # rotated in place and the keys and values stored into the cache in one native call
            kernels.rope_store(qkv, *rope, meta.slot_mapping, k_cache, v_cache, heads, kv_heads)
            q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        elif self.qk_norm:
            q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
            q = apply_rotary(self.q_norm(q), *rope)
            k = apply_rotary(self.k_norm(k), *rope)
        else:
            # q and k rotated together: half the ops of rotating each
            q, k = apply_rotary(qkv[:, :heads + kv_heads], *rope).split([heads, kv_heads], dim=1)
            v = qkv[:, heads + kv_heads:]
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, stored=stored)
        return self.o_proj(o.view(-1, heads * dim))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [inter, inter])
        self.down_proj = RowParallelLinear(inter, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if kernels.supports(gate_up.dtype, gate_up.device):
            return self.down_proj(kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
                v_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output (the embeddings at layer 0); residual: the running
        sum of the residual stream so far (None at layer 0). The add and the norm run fused."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, rope, k_cache, v_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    modalities: frozenset[str] = frozenset()  # text only: no `encode`
    uses_mrope = False  # positions are [T] (a multimodal decoder may swap in a rope taking [3, T])
    # checkpoint name fragment -> (our fused parameter, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.rope = RotaryEmbedding(config, _head_dim(config))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # (kv cache address, kernels.llama_layers' table or None): built on first use, after
        # the weights are loaded and packed
        self._native_table: tuple[int, Any] | None = None
        self._native_shape: kernels.LlamaShape | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """kv_cache: [layers, 2, kv_heads, slots, head_dim]. embeds: (index [n], rows [n, hidden]):
        the embeddings of the flat tokens at `index` are replaced by `rows` (a multimodal model's
        encoder output at its placeholder tokens)."""
        x = self.embed_tokens(input_ids)
        if embeds is not None:
            x.index_copy_(0, embeds[0], embeds[1].to(x.dtype))
        rope = self.rope.cos_sin(positions, x.dtype)
        native = self._native_layers(kv_cache, meta)
        if native is not None:
            x, residual = kernels.llama_layers(
                native, self._native_shape, x, *rope, meta.slot_mapping,
                meta.decode_block_tables, meta.decode_context_lens, kv_cache.shape[3],
                meta.block_size)
            return self.norm.add_forward(x, residual)[0]
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, kv_cache[i, 0], kv_cache[i, 1], meta)
        return self.norm.add_forward(x, residual)[0]

    def _native_layers(self, kv_cache: torch.Tensor, meta: AttentionMetadata) -> Any:
        """The layer table of `kernels.llama_layers` where it runs this step's layers (on a CPU,
        packed weights, one rank, no q/k norms or o_proj bias, every token attended as a
        decode row); None where the Python layers run."""
        if not meta.native_decode or meta.prefill_rows or kv_cache.device.type != "cpu":
            return None
        if self._native_table is None or self._native_table[0] != kv_cache.data_ptr():
            self._native_table = (kv_cache.data_ptr(), self._layer_table(kv_cache))
        return self._native_table[1]

    def _layer_table(self, kv_cache: torch.Tensor) -> Any:
        attn = self.layers[0].self_attn
        dtype = self.layers[0].input_layernorm.weight.dtype  # the activations' (the norms' own)
        if (tp_size() > 1 or attn.qk_norm
                or not kernels.supports_cache(dtype, kv_cache.dtype, kv_cache.device)):
            return None

        def packing(weight: torch.Tensor) -> str | None:
            """bf16 over AVX512-BF16 packing (4-d), float32 over bf16 packing (3-d) or over
            block-quantized packing (uint8)"""
            if weight.dtype == torch.uint8:
                return "quantized" if dtype == torch.float32 else None
            return {(torch.bfloat16, 4): "bf16", (torch.float32, 3): "mixed"}.get(
                (dtype, weight.dim()))

        table = (kernels.LlamaLayer * len(self.layers))()
        kinds = set()
        for i, layer in enumerate(self.layers):
            a, mlp = layer.self_attn, layer.mlp
            projections = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            kinds.update(packing(p.weight) for p in projections)
            if len(kinds) != 1 or None in kinds or a.o_proj.bias is not None:
                return None
            bias = a.qkv_proj.bias
            table[i] = kernels.LlamaLayer(
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(), a.qkv_proj.weight.data_ptr(),
                None if bias is None else bias.data_ptr(), a.o_proj.weight.data_ptr(),
                mlp.gate_up_proj.weight.data_ptr(), mlp.down_proj.weight.data_ptr(),
                kv_cache[i, 0].data_ptr(), kv_cache[i, 1].data_ptr())
        self._native_shape = kernels.LlamaShape(
            self.config.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            self.layers[0].mlp.gate_up_proj.out_features // 2,
            self.layers[0].input_layernorm.eps, attn.scale, kinds == {"quantized"},
            bf16_cache=dtype != kv_cache.dtype)
        return table

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def checkpoint_name(self, name: str) -> tuple[str, int]:
        """Maps an HF checkpoint tensor name to (our parameter name, shard index)."""
        name = name.removeprefix("model.")
        for fragment, (fused, shard) in self.packed_modules.items():
            if f".{fragment}." in name:
                return name.replace(fragment, fused), shard
        return name, 0
