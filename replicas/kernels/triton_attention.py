"""Decode attention over the paged KV cache on GPUs, as one Triton kernel.

The torch path gathers every row's blocks into a dense copy before two batched matmuls: at 256
rows on an H100 that copy was most of a bench-1b decode step. This kernel reads each key and
value once, straight from the cache through the block table: one program per (row, KV head)
walks the row's context a tile of keys at a time with an online softmax (float32), the query
heads that share the KV head (GQA) forming the rows of its matrix products. Context lengths and
block tables are read on the device, so the kernel can sit inside a CUDA graph.

Imported only where Triton is installed (CUDA builds of torch ship it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TILE = 64  # keys per iteration; tl.dot wants every dimension >= 16


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
                         stride_qb, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs,
                         stride_tb, stride_ob, stride_oh,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                         D_PAD: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
                         IEEE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    ctx = tl.load(lens_ptr + row)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < GROUP
    dmask = d < D
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    n = tl.arange(0, TILE)
    for start in range(0, ctx, TILE):
        keys = start + n
        kmask = keys < ctx
        block = tl.load(tables_ptr + row * stride_tb + keys // BLOCK, mask=kmask, other=0)
        slot = block * BLOCK + keys % BLOCK
        lmask = kmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + kvh * stride_kh + slot[:, None] * stride_ks + d[None, :],
                    mask=lmask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(kmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kvh * stride_vh + slot[:, None] * stride_vs + d[None, :],
                    mask=lmask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / total[:, None]
    tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           block_size: int, scale: float) -> torch.Tensor:
    """q [B, H, D]; caches [Hkv, slots, D]; block_tables [B, nb]; context_lens [B] (>= 1 each).
    Returns [B, H, D]; the same contract as the CPU kernel in `replicas.kernels`."""
    b, h, d = q.shape
    kv_heads = k_cache.shape[0]
    group = h // kv_heads
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("paged decode attention wants unit stride along head_dim")
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    _paged_decode_kernel[(b, kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0), out.stride(0),
        out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=d,
        D_PAD=max(16, triton.next_power_of_2(d)), BLOCK=block_size, TILE=_TILE,
        IEEE=q.dtype == torch.float32, num_warps=4)
    return out
