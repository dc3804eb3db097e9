"""Attention over the paged KV cache.

The cache of one layer is `[kv_heads, slots, head_dim]` for K and for V. A kernel of
`replicas.kernels` attends decode rows over it in place: native C on CPUs, Triton on GPUs.
Elsewhere (no C compiler, no Triton) a row's blocks are gathered as rows of the 2-D view
`[kv_heads * blocks, block_size * head_dim]`, which yields `[kv_heads, rows, keys, head_dim]`,
already the layout the two matmuls want.

The model runner describes one step with `AttentionMetadata` (built once per step, shared by every
layer): where each new token's K/V goes (`slot_mapping`) and, per row, which cache slots form its
context. Rows that add one token (decode) are attended in one call. Rows that add several
(prefill chunks) are attended, on CPUs with the native kernels, as one decode row per token (the
model runner describes them so: each token's context is its row's positions up to it); on CUDA
all in one variable-length flash-attention call over their gathered contexts (`VarlenPrefill`);
elsewhere one row at a time with a causal mask offset by their cached prefix (on a GPU that loop
cost ~6 launches per row per layer: with 44 rows a step, more than the step's matmuls)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cache
from importlib.util import find_spec

import torch
import torch.nn.functional as F

from replicas import kernels


@dataclass(frozen=True)
class PrefillRow:
    start: int  # first of this row's tokens in the flat step
    end: int
    context_slots: torch.Tensor | None  # cache slots of the whole context; None: no cached prefix


@dataclass(frozen=True)
class VarlenPrefill:
    """Every prefill row of a step as one variable-length attention (CUDA flash attention)."""

    token_index: torch.Tensor  # [Tq] flat positions of the prefill rows' tokens, row by row
    kv_slots: torch.Tensor  # [Tk] cache slots of each row's whole context, row by row
    cu_q: torch.Tensor  # [rows + 1] int32: row i's queries are token_index[cu_q[i]:cu_q[i + 1]]
    cu_k: torch.Tensor  # [rows + 1] int32: likewise its keys in kv_slots
    max_q: int
    max_k: int


@cache
def supports_varlen_prefill(dtype: torch.dtype, device: torch.device) -> bool:
    """torch's varlen flash attention (torch >= 2.10): CUDA and half precision."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    return find_spec("torch.nn.attention.varlen") is not None


@cache
def _varlen_has_gqa() -> bool:
    from torch.nn.attention.varlen import varlen_attn
    return "enable_gqa" in inspect.signature(varlen_attn).parameters  # torch >= 2.12


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    prefill_rows: tuple[PrefillRow, ...]
    block_size: int = 16
    decode_token_index: torch.Tensor | None = None  # [Bd] flat positions of the decode rows' tokens
    decode_block_tables: torch.Tensor | None = None  # [Bd, max blocks] padded with block 0
    decode_context_lens: torch.Tensor | None = None  # [Bd] keys each decode row attends to
    native_decode: bool = False  # decode rows through kernels.paged_decode_attention: none below
    # the torch path: [Hkv * Bd * max blocks] rows h * num_blocks + block of the cache viewed as
    # [Hkv * num_blocks, block_size * D], in (kv head, row, block) order
    decode_gather_index: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, max blocks * block size] True: real key
    # reused by every layer for the decode gathers: fresh multi-MB tensors per layer would be
    # page-faulted in (and zeroed by the kernel) every time
    decode_k_buffer: torch.Tensor | None = None
    decode_v_buffer: torch.Tensor | None = None
    prefill_varlen: VarlenPrefill | None = None  # set: prefill_rows are attended through it


def gather_fields(tables: torch.Tensor, lens: torch.Tensor, head_offsets: torch.Tensor,
                  block_size: int, k_buffer: torch.Tensor | None,
                  v_buffer: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """The torch path's decode fields of `AttentionMetadata`, on the tables' device: tables
    [Bd, nb], lens [Bd], head_offsets [Hkv, 1] (each KV head's first row of the 2-D view)."""
    keys = tables.shape[1] * block_size
    mask = torch.arange(keys, device=tables.device).unsqueeze(0) < lens.unsqueeze(1)
    return {"decode_gather_index": (head_offsets + tables.flatten()).flatten(),
            "decode_mask": mask[:, None, None, :],
            "decode_k_buffer": k_buffer, "decode_v_buffer": v_buffer}


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    stored: bool = False) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; caches: [Hkv, slots, D], of q's type or narrower (a
    bf16 cache under float32 compute: what is read from it is widened). Returns [T, H, D].
    stored: k and v are in the cache already (kernels.rope_store put them there)."""
    if not stored:
        # index_copy_/index_select: much faster on CPU than advanced-index assignment and gather
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(v_cache.dtype))
    if meta.native_decode and not meta.prefill_rows:
        # every token is a decode row's, in row order: no selecting and scattering
        return kernels.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                              meta.decode_context_lens, meta.block_size, scale)
    out = torch.empty_like(q)
    if meta.native_decode:
        o = kernels.paged_decode_attention(q.index_select(0, meta.decode_token_index), k_cache,
                                           v_cache, meta.decode_block_tables,
                                           meta.decode_context_lens, meta.block_size, scale)
        out.index_copy_(0, meta.decode_token_index, o)
    elif meta.decode_token_index is not None:
        # gather whole blocks (block_size x head_dim contiguous bytes each) as rows of a 2-D view:
        # index_select along dim 0 is a parallel memcpy per row; along dim 1 of the 4-D view it
        # was several times slower
        tables = meta.decode_block_tables  # [Bd, nb]
        kv_heads, slots, dim = k_cache.shape
        rows = (kv_heads * slots // meta.block_size, meta.block_size * dim)
        shape = (kv_heads, tables.shape[0], tables.shape[1] * meta.block_size, dim)
        index = meta.decode_gather_index
        kd = torch.index_select(k_cache.view(rows), 0, index,
                                out=_buffer(meta.decode_k_buffer, k_cache, rows, index))
        vd = torch.index_select(v_cache.view(rows), 0, index,
                                out=_buffer(meta.decode_v_buffer, v_cache, rows, index))
        kd, vd = kd.view(shape).to(q.dtype), vd.view(shape).to(q.dtype)
        o = decode_attention(q.index_select(0, meta.decode_token_index), kd, vd,
                             meta.decode_mask, scale)
        out.index_copy_(0, meta.decode_token_index, o)
    if meta.prefill_varlen is not None:
        out.index_copy_(0, meta.prefill_varlen.token_index,
                        _varlen_prefill(q, k_cache, v_cache, meta.prefill_varlen, scale))
        return out
    for row in meta.prefill_rows:
        qp = q[row.start:row.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if row.context_slots is None:
            # rounded as the cache holds them, so a prompt's tokens do not depend on its chunks
            kp = _as_cached(k[row.start:row.end], k_cache).transpose(0, 1).unsqueeze(0)
            vp = _as_cached(v[row.start:row.end], v_cache).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            # [1, Hkv, ctx, D]
            kp = k_cache.index_select(1, row.context_slots).unsqueeze(0).to(q.dtype)
            vp = v_cache.index_select(1, row.context_slots).unsqueeze(0).to(q.dtype)
            nq, nk = qp.shape[2], kp.shape[2]
            # query i sits at absolute position nk - nq + i and sees keys up to it
            mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(diagonal=nk - nq)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[row.start:row.end] = o.squeeze(0).transpose(0, 1)
    return out


def _varlen_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    pv: VarlenPrefill, scale: float) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn
    # each row's keys are its whole context, new tokens included (already in the cache); with
    # more keys than queries, flash's causal mask aligns the last query with the last key
    kp = k_cache.transpose(0, 1).index_select(0, pv.kv_slots)  # [Tk, Hkv, D]
    vp = v_cache.transpose(0, 1).index_select(0, pv.kv_slots)
    gqa: dict[str, bool] = {}
    if _varlen_has_gqa():
        gqa["enable_gqa"] = True
    elif q.shape[1] != kp.shape[1]:
        kp = kp.repeat_interleave(q.shape[1] // kp.shape[1], dim=1)
        vp = vp.repeat_interleave(q.shape[1] // vp.shape[1], dim=1)
    return varlen_attn(q.index_select(0, pv.token_index), kp, vp, pv.cu_q, pv.cu_k, pv.max_q,
                       pv.max_k, scale=scale, window_size=(-1, 0), **gqa)


def _as_cached(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x rounded to the cache's type and back (unchanged where they are one type)."""
    return x if x.dtype == cache.dtype else x.to(cache.dtype).to(x.dtype)


def _buffer(buf: torch.Tensor | None, cache: torch.Tensor, rows: tuple[int, int],
            index: torch.Tensor) -> torch.Tensor:
    shape = (index.numel(), rows[1])
    if buf is None:
        return cache.new_empty(shape)
    return buf[: shape[0] * shape[1]].view(shape)


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
