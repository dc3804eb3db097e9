"""Attention over the paged KV cache.

The cache of one layer is `[kv_heads, slots, head_dim]` for K and for V: gathering a row's context
slots along dim 1 yields `[kv_heads, keys, head_dim]`, already the layout the matmuls want, so the
decode path copies nothing but the gather itself.

The model runner describes one step with `AttentionMetadata` (built once per step, shared by every
layer): where each new token's K/V goes (`slot_mapping`) and, per row, which cache slots form its
context. Rows that add one token (decode) are attended in one batched call over a padded gather;
rows that add several (prefill chunks) are attended one row at a time with a causal mask offset by
their cached prefix."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillRow:
    start: int  # first of this row's tokens in the flat step
    end: int
    context_slots: torch.Tensor | None  # cache slots of the whole context; None: no cached prefix


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    decode_token_index: torch.Tensor | None  # [Bd] flat positions of the decode rows' tokens
    decode_block_tables: torch.Tensor | None  # [Bd, max blocks] padded with block 0
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max blocks * block size] True: a real key
    prefill_rows: tuple[PrefillRow, ...]
    block_size: int = 16
    # reused by every layer for the decode gathers: fresh multi-MB tensors per layer would be
    # page-faulted in (and zeroed by the kernel) every time
    decode_k_buffer: torch.Tensor | None = None
    decode_v_buffer: torch.Tensor | None = None


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; caches: [Hkv, slots, D]. Returns [T, H, D]."""
    # index_copy_/index_select: much faster on CPU than advanced-index assignment and gather
    k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    out = torch.empty_like(q)
    if meta.decode_token_index is not None:
        # gather whole blocks (block_size x head_dim contiguous bytes each), not single slots:
        # a few large copies instead of one small copy per key
        tables = meta.decode_block_tables  # [Bd, nb]
        kv_heads, _, dim = k_cache.shape
        blocked = (kv_heads, -1, meta.block_size, dim)
        shape = (kv_heads, tables.shape[0], tables.shape[1] * meta.block_size, dim)
        flat = tables.flatten()
        kd = torch.index_select(k_cache.view(blocked), 1, flat,
                                out=_buffer(meta.decode_k_buffer, k_cache, blocked, flat))
        vd = torch.index_select(v_cache.view(blocked), 1, flat,
                                out=_buffer(meta.decode_v_buffer, v_cache, blocked, flat))
        kd, vd = kd.view(shape), vd.view(shape)
        o = decode_attention(q.index_select(0, meta.decode_token_index), kd, vd,
                             meta.decode_mask, scale)
        out.index_copy_(0, meta.decode_token_index, o)
    for row in meta.prefill_rows:
        qp = q[row.start:row.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if row.context_slots is None:
            kp = k[row.start:row.end].transpose(0, 1).unsqueeze(0)
            vp = v[row.start:row.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            kp = k_cache.index_select(1, row.context_slots).unsqueeze(0)  # [1, Hkv, ctx, D]
            vp = v_cache.index_select(1, row.context_slots).unsqueeze(0)
            nq, nk = qp.shape[2], kp.shape[2]
            # query i sits at absolute position nk - nq + i and sees keys up to it
            mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(diagonal=nk - nq)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[row.start:row.end] = o.squeeze(0).transpose(0, 1)
    return out


def _buffer(buf: torch.Tensor | None, cache: torch.Tensor, blocked: tuple,
            flat: torch.Tensor) -> torch.Tensor:
    shape = (blocked[0], flat.numel(), blocked[2], blocked[3])
    if buf is None:
        return cache.new_empty(shape)
    return buf[: shape[0] * shape[1] * shape[2] * shape[3]].view(shape)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per row: q [B, H, D], k/v [Hkv, B, K, D], mask [B, 1, 1, K] -> [B, H, D].

    Two batched matmuls over (kv head, row) with the query heads of a KV head grouped together;
    on CPUs this is an order of magnitude faster than SDPA's flash kernel for a single query
    (which tiles for long queries). Softmax runs in float32."""
    b, h, d = q.shape
    kv_heads, keys = k.shape[0], k.shape[2]
    qg = q.view(b, kv_heads, h // kv_heads, d).transpose(0, 1)  # [Hkv, B, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [Hkv, B, G, K]
    scores.masked_fill_(~mask.view(1, b, 1, keys), float("-inf"))
    probs = scores.softmax(-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(b, h, d)
