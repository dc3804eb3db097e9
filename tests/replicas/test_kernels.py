"""The native decode-attention kernel against the torch path, on ragged rows and shuffled blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replicas import kernels, sampler
from replicas.attention import AttentionMetadata, paged_attention

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="no C compiler for the kernels")

KV_HEADS, BLOCKS, BLOCK = 2, 64, 16


def _case(dtype: torch.dtype, heads: int, lens: list[int], seed: int = 0, dim: int = 64,
          blocks: int = BLOCKS):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(KV_HEADS, blocks * BLOCK, dim, generator=g).to(dtype)
    v_cache = torch.randn(KV_HEADS, blocks * BLOCK, dim, generator=g).to(dtype)
    width = max(-(-n // BLOCK) for n in lens)
    # every row draws its blocks from a shuffled pool, as after many allocations and frees
    pool = torch.randperm(blocks, generator=g)
    tables = torch.stack([pool[i * width:(i + 1) * width] for i in range(len(lens))])
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


def _reference(q, k_cache, v_cache, tables, lens, scale):
    """Attention of each row alone over its slots, in float64."""
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        slots = torch.cat([torch.arange(int(blk) * BLOCK, (int(blk) + 1) * BLOCK)
                           for blk in tables[b]])[:n]
        k = k_cache[:, slots].double().repeat_interleave(q.shape[1] // KV_HEADS, 0)
        v = v_cache[:, slots].double().repeat_interleave(q.shape[1] // KV_HEADS, 0)
        probs = (torch.einsum("hd,hkd->hk", q[b].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hk,hkd->hd", probs, v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads", [2, 6])  # one query head per KV head, and groups of three
# 48, 64 and 128 take the vector path (48: a partial value tile on AVX2); 36, not a multiple of
# AVX's 8 lanes, the row loops on x86
@pytest.mark.parametrize("dim", [36, 48, 64, 128])
def test_kernel_matches_reference(dtype: torch.dtype, atol: float, heads: int, dim: int) -> None:
    lens = [1, 15, 16, 17, 100, 3]
    q, k_cache, v_cache, tables, lens_t = _case(dtype, heads, lens, dim=dim)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens_t, BLOCK, 0.3)
    assert out.dtype == dtype and out.shape == q.shape
    ref = _reference(q, k_cache, v_cache, tables, lens_t, 0.3)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


# contexts past one part (PART_TOKENS = 2048 in paged_attention.c) are split into equal parts
# and combined: two parts and three, ragged and whole last blocks, beside unsplit rows
LONG = [2049, 4200, 2048, 40, 4096, 6145]


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads", [2, 6])
@pytest.mark.parametrize("dim", [48, 64, 128])
def test_long_contexts_are_split_and_combined(dtype: torch.dtype, atol: float, heads: int,
                                              dim: int) -> None:
    q, k_cache, v_cache, tables, lens_t = _case(dtype, heads, LONG, dim=dim, blocks=2400)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens_t, BLOCK, 0.3)
    ref = _reference(q, k_cache, v_cache, tables, lens_t, 0.3)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_its_batch_or_team(dtype: torch.dtype) -> None:
    """A row is split by its own length alone, and its parts combined in one order: alone, in
    any batch and on any team it gives the same bits (a request's tokens must not change with
    what runs beside it)."""
    q, k_cache, v_cache, tables, lens_t = _case(dtype, 6, LONG, dim=64, blocks=2400)
    batch = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens_t, BLOCK, 0.3)
    for b in range(len(LONG)):
        alone = kernels.paged_decode_attention(q[b:b + 1], k_cache, v_cache, tables[b:b + 1],
                                               lens_t[b:b + 1], BLOCK, 0.3)
        assert torch.equal(alone[0], batch[b]), b
    threads = torch.get_num_threads()
    try:
        for team in (1, 3, 8):
            torch.set_num_threads(team)
            again = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens_t, BLOCK,
                                                   0.3)
            assert torch.equal(again, batch), team
    finally:
        torch.set_num_threads(threads)


def test_many_split_rows_go_in_waves_with_the_same_bits() -> None:
    """A long prefill chunk's split rows have more parts than one wave's partial results hold
    (WAVE_TASKS = 4096 tasks): they go in waves, each combined before the next, and give the
    bits each row gives in a small batch."""
    g = torch.Generator().manual_seed(5)
    rows, width = 1200, -(-4000 // BLOCK)
    k_cache = torch.randn(KV_HEADS, width * BLOCK, 64, generator=g).bfloat16()
    v_cache = torch.randn(KV_HEADS, width * BLOCK, 64, generator=g).bfloat16()
    # a prompt's last tokens, each past one part: every row shares the prompt's blocks
    tables = torch.randperm(width, generator=g).expand(rows, width).contiguous()
    lens = torch.arange(4000 - rows + 1, 4001)
    q = torch.randn(rows, 6, 64, generator=g).bfloat16()
    whole = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, BLOCK, 0.3)
    for b in range(0, rows, 150):
        part = kernels.paged_decode_attention(q[b:b + 150], k_cache, v_cache, tables[b:b + 150],
                                              lens[b:b + 150], BLOCK, 0.3)
        assert torch.equal(part, whole[b:b + 150]), b
    pick = [0, 599, 1199]
    ref = _reference(q[pick], k_cache, v_cache, tables[pick], lens[pick], 0.3)
    torch.testing.assert_close(whole[pick].double(), ref, atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[5, 20], [6, 33]])  # odd and even tails (bf16 pairs keys)
def test_kernel_ignores_slots_past_the_context(dtype: torch.dtype, lens: list[int]) -> None:
    q, k_cache, v_cache, tables, lens = _case(dtype, 6, lens)
    before = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, BLOCK, 0.3)
    # poison every slot past each row's context within its blocks
    for b, n in enumerate(lens.tolist()):
        slots = torch.cat([torch.arange(int(blk) * BLOCK, (int(blk) + 1) * BLOCK)
                           for blk in tables[b]])[n:]
        k_cache[:, slots] = 1e4
        v_cache[:, slots] = float("nan")
    after = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, BLOCK, 0.3)
    assert torch.equal(before, after)


# 36: the row loops on x86; 64 and 128 the vector path; lengths past a part (2,048) split
@pytest.mark.parametrize("dim,lens", [(36, [1, 17, 100]), (64, [1, 15, 16, 17, 100, 3]),
                                      (128, [3, 2049, 40])])
def test_float32_queries_over_a_bf16_cache_give_the_widened_caches_bits(
        dim: int, lens: list[int]) -> None:
    """--kv-cache-dtype bfloat16 under float32 compute: the kernel widens each block it reads,
    so it gives the float32 kernel's bits over the same cache widened; and the reference's."""
    q, k_cache, v_cache, tables, lens_t = _case(torch.bfloat16, 6, lens, dim=dim, blocks=400)
    q = q.float() + 1e-3 * torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    assert kernels.supports_paged_decode(torch.float32, torch.device("cpu"), torch.bfloat16)
    mixed = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens_t, BLOCK, 0.3)
    assert mixed.dtype == torch.float32
    wide = kernels.paged_decode_attention(q, k_cache.float(), v_cache.float(), tables, lens_t,
                                          BLOCK, 0.3)
    assert torch.equal(mixed, wide)
    ref = _reference(q, k_cache, v_cache, tables, lens_t, 0.3)
    torch.testing.assert_close(mixed.double(), ref, atol=1e-5, rtol=0)


def test_only_float32_over_bf16_mixes() -> None:
    cpu = torch.device("cpu")
    assert kernels.supports_cache(torch.float32, torch.bfloat16, cpu)
    assert not kernels.supports_cache(torch.bfloat16, torch.float32, cpu)
    assert not kernels.supports_cache(torch.float32, torch.float16, cpu)
    assert not kernels.supports_paged_decode(torch.float32, torch.device("cuda"), torch.bfloat16)


def test_native_and_torch_decode_paths_agree() -> None:
    """paged_attention with the kernel and with the gather path (used on GPUs) give one result."""
    heads, lens = 6, [3, 40, 17]
    q, k_cache, v_cache, tables, lens_t = _case(torch.float32, heads, lens, seed=1)
    new_k = torch.randn(len(lens), KV_HEADS, 64)
    new_v = torch.randn(len(lens), KV_HEADS, 64)
    # the new token of each row sits at position len - 1
    slot_mapping = torch.tensor([int(tables[b, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK
                                 for b, n in enumerate(lens)])
    common = {"slot_mapping": slot_mapping, "prefill_rows": (), "block_size": BLOCK,
              "decode_token_index": torch.arange(len(lens)), "decode_block_tables": tables,
              "decode_context_lens": lens_t}
    native = AttentionMetadata(**common, native_decode=True)
    width = tables.shape[1]
    heads_offset = torch.arange(KV_HEADS).unsqueeze(1) * BLOCKS
    gathered = AttentionMetadata(
        **common, decode_gather_index=(heads_offset + tables.flatten()).flatten(),
        decode_mask=(torch.arange(width * BLOCK)[None] < lens_t[:, None])[:, None, None, :])
    out_native = paged_attention(q, new_k, new_v, k_cache.clone(), v_cache.clone(), native, 0.2)
    out_torch = paged_attention(q, new_k, new_v, k_cache.clone(), v_cache.clone(), gathered, 0.2)
    torch.testing.assert_close(out_native, out_torch, atol=1e-5, rtol=0)
    # and the new keys were written and attended: the result differs from the old cache's
    stale = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens_t, BLOCK, 0.2)
    assert not torch.allclose(out_native, stale)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
@pytest.mark.parametrize("rows", [1, 80])  # one decode row, and enough rows to run in parallel
def test_add_rms_norm_rounds_as_transformers(dtype: torch.dtype, atol: float, rows: int) -> None:
    g = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(rows, 96, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(96, generator=g).to(dtype)

    def hf_norm(h: torch.Tensor) -> torch.Tensor:  # transformers' LlamaRMSNorm
        f = h.float()
        return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

    total = x + residual
    fused = residual.clone()
    out = kernels.add_rms_norm(x, fused, weight, 1e-6)
    assert torch.equal(fused, total)  # the sum is written into the residual, in place
    torch.testing.assert_close(out, hf_norm(total), atol=atol, rtol=0)
    plain = kernels.add_rms_norm(x, None, weight, 1e-6)
    torch.testing.assert_close(plain, hf_norm(x), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 70])  # decode-sized, and enough tokens to run in parallel
def test_rope_store_matches_torch_rotation_and_cache_writes(dtype: torch.dtype,
                                                            tokens: int) -> None:
    from replicas.models.rope import apply_rotary
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, slots = 6, 2, 64, 256
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    angles = torch.rand(tokens, 1, dim // 2, generator=g) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slot_mapping = torch.randperm(slots, generator=g)[:tokens]
    k_cache, v_cache = (torch.randn(kv_heads, slots, dim, generator=g).to(dtype) for _ in "kv")
    ref_k, ref_v = k_cache.clone(), v_cache.clone()

    rotated = apply_rotary(qkv[:, :heads + kv_heads], cos, sin)
    ref_k.index_copy_(1, slot_mapping, rotated[:, heads:].transpose(0, 1))
    ref_v.index_copy_(1, slot_mapping, qkv[:, heads + kv_heads:].transpose(0, 1))
    values = qkv[:, heads + kv_heads:].clone()

    kernels.rope_store(qkv, cos, sin, slot_mapping, k_cache, v_cache, heads, kv_heads)
    # bf16: bit-identical (each product rounded as torch rounds it); float32: within an ulp or
    # so (the compiler may fuse a product into the sum)
    same = torch.equal if dtype == torch.bfloat16 else (
        lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-6))
    assert same(qkv[:, :heads + kv_heads], rotated)  # rotated in place
    assert torch.equal(qkv[:, heads + kv_heads:], values)  # values untouched
    assert same(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # other slots untouched


@pytest.mark.parametrize("tokens", [3, 70])
def test_rope_store_rounds_float32_keys_and_values_into_a_bf16_cache(tokens: int) -> None:
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, slots = 6, 2, 64, 256
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=g)
    angles = torch.rand(tokens, 1, dim // 2, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    slot_mapping = torch.randperm(slots, generator=g)[:tokens]
    k_cache, v_cache = (torch.randn(kv_heads, slots, dim, generator=g).bfloat16() for _ in "kv")
    wide_k, wide_v = k_cache.float(), v_cache.float()
    wide_qkv = qkv.clone()
    kernels.rope_store(wide_qkv, cos, sin, slot_mapping, wide_k, wide_v, heads, kv_heads)
    kernels.rope_store(qkv, cos, sin, slot_mapping, k_cache, v_cache, heads, kv_heads)
    assert torch.equal(qkv, wide_qkv)  # the rotation in float32 as before
    # the stored rows are the float32 ones rounded to nearest even; the rest of the cache as was
    assert torch.equal(k_cache, wide_k.bfloat16()) and torch.equal(v_cache, wide_v.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [2, 70])
def test_silu_mul_matches_torch(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(rows, 2 * 200, generator=g) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    out = kernels.silu_mul(x)
    assert out.shape == (rows, 200) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        return
    # exp may differ from torch's in the last float32 bit; after rounding to bf16 that moves a
    # result by at most one unit in the last place, and rarely
    ulp = torch.finfo(dtype).eps * ref.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((out - ref).abs().float() <= ulp.float() * 1.01).all()
    assert (out != ref).float().mean() < 0.01


def _fast_linear() -> bool:
    lib = kernels.load()
    return lib is not None and bool(lib.linear_bf16_fast())


needs_fast_linear = pytest.mark.skipif(not _fast_linear(), reason="the CPU lacks AVX512-BF16")


# rows: one decode row, an 8-row tile plus remainders, more rows than tiles; n: whole 32-column
# panels, a half panel and ragged ones; k: even, odd (a zero-padded last pair)
@needs_fast_linear
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33, 64, 80])  # streamed, a tile, chunked, prefill
@pytest.mark.parametrize("n,k", [(8, 64), (13, 70), (37, 19), (96, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_torch(rows: int, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    assert kernels.packs_linear(w)
    out = kernels.linear(x, kernels.pack_linear(w), n, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    # float32 accumulation rounded once to bf16, as torch's: within one bf16 rounding of the
    # exact product, and so within two of torch's (which sums in another order)
    ulp = exact.abs().clamp_min(1e-3) * 2.0 ** -8
    assert ((out.double() - exact).abs() <= ulp + 1e-4).all()
    torch_out = torch.nn.functional.linear(x, w, b).double()
    assert ((out.double() - torch_out).abs() <= 2 * ulp + 1e-4).all()


@needs_fast_linear
@pytest.mark.parametrize("rows", [9, 33, 64])
@pytest.mark.parametrize("k", [70, 19, 576])
def test_decode_batches_sum_as_single_tiles_do(rows: int, k: int) -> None:
    """Between one tile and 64 rows the tiles take turns over each panel chunk by chunk
    (linear.c's panel_rows); every output still sums its products in the same order as a call
    of a tile's rows, bit for bit."""
    g = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(70, k, generator=g).bfloat16()
    b = torch.randn(70, generator=g).bfloat16()
    packed = kernels.pack_linear(w)
    whole = kernels.linear(x, packed, 70, b)
    tiles = torch.cat([kernels.linear(x[m:m + 8], packed, 70, b) for m in range(0, rows, 8)])
    assert torch.equal(whole, tiles)


@needs_fast_linear
def test_linear_keeps_leading_dims() -> None:
    x, w = torch.randn(2, 3, 40).bfloat16(), torch.randn(24, 40).bfloat16()
    out = kernels.linear(x, kernels.pack_linear(w), 24)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out.float(), torch.nn.functional.linear(x, w).float(),
                               rtol=2 ** -7, atol=1e-2)


def test_linear_rejects_what_it_cannot_multiply() -> None:
    x = torch.randn(2, 8).bfloat16()
    packed = kernels.pack_linear(torch.randn(4, 8).bfloat16())
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.linear(x.float(), packed, 4)
    with pytest.raises(ValueError, match="does not take"):
        kernels.linear(torch.randn(2, 6).bfloat16(), packed, 4)
    with pytest.raises(ValueError, match="does not take"):
        kernels.linear(x, packed, 33)  # more columns than the packed panels hold


def test_only_bf16_weights_on_fast_cpus_are_packed() -> None:
    w = torch.randn(16, 64).bfloat16()
    assert kernels.packs_linear(w) is _fast_linear()
    assert not kernels.packs_linear(w.float())  # float32: torch's MKL
    assert not kernels.packs_linear(w[0])


def test_loading_the_kernels_leaves_subnormal_floats_alone() -> None:
    """The library is built with -ffast-math; linked with it, GCC's crtfastmath.o would turn on
    flush-to-zero for the whole process that loads it (torch's and Python's floats too)."""
    import subprocess
    import sys
    code = ("import sys; from replicas import kernels; assert kernels.load() is not None; "
            "import torch; tiny = sys.float_info.min / 4; "
            "print(tiny > 0, float(torch.tensor(tiny, dtype=torch.float64) * 1.0) > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr


# float32 compute over bf16-valued weights (linear_mixed), on every build: rows across the row
# tile (6 or 8) and the 48-row block with remainders; n whole and ragged panels (8, 16 or 32)
@pytest.mark.skipif(kernels.load() is None, reason="no native kernels here")
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 50, 97])
@pytest.mark.parametrize("n,k", [(8, 64), (13, 70), (37, 19), (96, 576), (200, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_mixed_matches_float32_linear(rows: int, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g).bfloat16().float()
    b = torch.randn(n, generator=g) if bias else None
    assert kernels.packs_mixed(w)
    packed = kernels.pack_mixed(w)
    assert packed.dtype == torch.bfloat16 and packed.numel() * 2 < w.numel() * 4 + 2 * 32 * k
    out = kernels.linear_mixed(x, packed, n, b)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    # float32 sums in another order than torch's: within float32's rounding of the sum
    bound = 1e-6 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.skipif(kernels.load() is None, reason="no native kernels here")
@pytest.mark.parametrize("n,k", [(37, 19), (200, 576)])
def test_linear_mixed_gives_a_row_the_same_bits_alone_as_in_any_batch(n: int, k: int) -> None:
    """One or two rows go over several panels at once, more rows in tiles of 6 or 8 over one
    panel: each column's sum runs over k in one order on every path, so a request's logits do
    not depend on what shares its step (the engine's exactness tests rest on it)."""
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(64, k, generator=g)
    w = torch.randn(n, k, generator=g).bfloat16().float()
    b = torch.randn(n, generator=g)
    packed = kernels.pack_mixed(w)
    alone = torch.cat([kernels.linear_mixed(x[i:i + 1], packed, n, b) for i in range(len(x))])
    for rows in (2, 3, 7, 32, 64):
        assert torch.equal(kernels.linear_mixed(x[:rows], packed, n, b), alone[:rows]), rows


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_few_row_calls_give_the_same_bits_on_any_team(rows: int) -> None:
    """Up to 8 rows each thread streams a share of the panels and steals from the others'
    (deal.h's `Stolen`). Teams larger than the panels, than the ranges' split and than the
    cores (whose threads the OS preempts, so stealing happens) must still compute every panel
    exactly once: the same bits as one thread, call after call."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from replicas import quant

    g = torch.Generator().manual_seed(rows)
    calls = []
    for n, k in [(13, 64), (96, 576), (1000, 64)]:  # 1, 3 and 32 panels of 32 columns
        x = torch.randn(rows, k, generator=g)
        w = torch.randn(n, k, generator=g).bfloat16()
        calls.append(lambda x=x, p=kernels.pack_mixed(w.float()), n=n:
                     kernels.linear_mixed(x, p, n))
        raw = torch.from_numpy(np.ascontiguousarray(quantize(
            w.float().numpy(), GGMLQuantizationType.Q4_1)))
        calls.append(lambda x=x, p=quant.pack(raw, quant.Q4_1, kernels.float32_panel()), n=n:
                     kernels.linear_q(x, p, n))
        if _fast_linear():
            calls.append(lambda x=x.bfloat16(), p=kernels.pack_linear(w), n=n:
                         kernels.linear(x, p, n))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [call() for call in calls]
        for team in (2, 3, 5, 8):
            torch.set_num_threads(team)
            for _ in range(20):
                for call, want in zip(calls, alone, strict=True):
                    assert torch.equal(call(), want), team
    finally:
        torch.set_num_threads(threads)


def test_only_exact_bf16_weights_are_kept_as_bf16() -> None:
    w = torch.randn(16, 32)
    assert not kernels.packs_mixed(w)  # a float32 checkpoint keeps its precision
    assert not kernels.packs_mixed(w.bfloat16())  # bf16 compute packs for dot products instead
    assert kernels.packs_mixed(w.bfloat16().float()) is (kernels.load() is not None)


@pytest.mark.parametrize("rows,n,k", [(1, 49152, 64), (32, 4096, 64), (3, 5000, 256), (2, 200, 200),
                                      (4, 17, 5), (2, 15, 1)])
def test_topk_gives_torchs_values_and_indices(rows: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, n, generator=g) * 7
    x[0, : n // 2] = float("-inf")  # a row with banned tokens
    assert kernels.supports_topk(x, k)
    values, indices = kernels.topk(x, k)
    want_values, want_indices = x.topk(k, dim=-1)
    assert torch.equal(values, want_values)
    finite = torch.isfinite(want_values)  # -inf ties may come in another order
    assert torch.equal(indices[finite], want_indices[finite])
    assert torch.equal(x.gather(1, indices), values)


def test_topk_puts_equal_values_lower_index_first_and_takes_only_what_it_can() -> None:
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, float("-inf"), 0.5]])
    values, indices = kernels.topk(x, 4)
    assert values.tolist() == [[3.0, 3.0, 3.0, 2.0]] and indices.tolist() == [[1, 2, 4, 3]]
    assert not kernels.supports_topk(x.bfloat16(), 4)
    assert not kernels.supports_topk(x, 8)  # more than the row
    assert not kernels.supports_topk(torch.zeros(2, 5000), kernels.TOPK_MAX + 1)


@pytest.mark.parametrize("rows,n", [(1, 49152), (32, 4096), (3, 5003), (2, 17), (1, 1)])
def test_argmax_gives_torchs_index(rows: int, n: int) -> None:
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g) * 5
    x[0, : n // 2] = float("-inf")  # a row with banned tokens
    assert torch.equal(kernels.argmax(x), x.argmax(-1))


def test_argmax_takes_the_first_of_equal_values_and_a_nan_first() -> None:
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    x[0, [70, 129, 250]] = 9.0  # ties, past the first block of the scan
    x[1, [7, 200]] = float("nan")
    x[1, 100] = 50.0
    x[2] = float("-inf")
    x[3, 299] = float("inf")
    x[4, [5, 6]] = float("nan")
    want = [70, 7, 0, 299, 5]
    assert kernels.argmax(x).tolist() == want == x.argmax(-1).tolist()


@pytest.mark.parametrize("rows,n,k", [(32, 49152, 5), (3, 5003, 20), (2, 17, 0), (1, 300, 256)])
def test_logprobs_match_log_softmax_its_ranks_and_topk(rows: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(rows + n + k)
    x = torch.randn(rows, n, generator=g) * 4
    x[0, : n // 3] = float("-inf")  # masked tokens: no mass, ranked last
    tokens = torch.randint(n // 3, n, (rows,), generator=g)
    tokens[-1] = int(x[-1].argmax())  # the most likely: rank 1, the first alternative
    assert kernels.supports_logprobs(x, k)
    chosen, ranks, values, ids = kernels.logprobs(x, tokens, k)
    ref = x.log_softmax(-1)
    torch.testing.assert_close(chosen, ref.gather(1, tokens.unsqueeze(1)).squeeze(1),
                               atol=2e-5, rtol=0)
    assert torch.equal(ranks, (x > x.gather(1, tokens.unsqueeze(1))).sum(1) + 1)
    assert int(ranks[-1]) == 1
    want_values, want_ids = ref.topk(k, dim=-1)
    finite = torch.isfinite(want_values)  # -inf ties may come in another order
    assert torch.equal(ids[finite], want_ids[finite])
    torch.testing.assert_close(values, want_values, atol=2e-5, rtol=0)
    if k:  # the same arithmetic: the top token's value is its chosen value exactly
        assert float(values[-1, 0]) == float(chosen[-1])
    assert not kernels.supports_logprobs(x, kernels.TOPK_MAX + 1)
    assert not kernels.supports_logprobs(x.bfloat16(), k)
    with pytest.raises(ValueError):  # a token past the row is refused, not read
        kernels.logprobs(x, torch.full((rows,), n), k)


@pytest.mark.parametrize("rows,n,words,constrained", [(32, 49152, 1536, None), (5, 1000, 30, [0, 3]),
                                                       (3, 70, 3, [2]), (2, 64, 1, None),
                                                       (4, 100, 4, [])])
def test_bitmask_gives_structureds_logits(rows: int, n: int, words: int,
                                          constrained: list[int] | None) -> None:
    """The native bitmask against structured's: the same -inf everywhere, words past the
    vocabulary or short of it (tokens past 32 W disallowed), all-allowed and all-banned words."""
    from structured.bitmask import apply_bitmask
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, words), dtype=torch.int32, generator=g)
    mask[:, 0] = -1  # every token of the word allowed
    if words > 2:
        mask[:, 1] = 0  # none
    got, want = x.clone(), x.clone()
    kernels.apply_bitmask(got, mask, constrained)
    apply_bitmask(want, mask, constrained)
    assert torch.equal(got, want)


def _inverse_cdf64(logits: torch.Tensor, u: float) -> int | None:
    """The token the inverse transform gives for u over a row's logits, in float64; None where u
    lies too near a boundary for float32 sums to agree on it."""
    probs = (logits.double() - logits.max().double()).exp()
    cdf = probs.cumsum(0) / probs.sum()
    token = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True))
    near = (cdf - u).abs().min()
    return None if near < 1e-5 else min(token, logits.numel() - 1)


def _draw(x: torch.Tensor, u: list[float], top_k: int | None = None, top_p: float = 1.0,
          min_p: float = 0.0):
    """kernels.draw of the row x at each u (one row each)."""
    rows, vocab = len(u), x.numel()
    return kernels.draw(x.expand(rows, -1).contiguous(),
                        torch.full((rows,), top_k or vocab, dtype=torch.int64),
                        torch.full((rows,), top_p), torch.full((rows,), min_p), torch.tensor(u),
                        sampler.FIRST_CANDIDATES)


def test_draw_inverts_the_running_sum_of_the_rows_probabilities() -> None:
    g = torch.Generator().manual_seed(21)
    x = torch.randn(5003, generator=g) * 3  # an odd length: every tail of the blocks is taken
    x[torch.randperm(5003, generator=g)[:2000]] = float("-inf")
    u = torch.rand(400, generator=g).tolist() + [0.0]
    tokens, closed = _draw(x, u)
    assert bool(closed.all())
    checked = 0
    for t, ui in zip(tokens.tolist(), u):
        want = _inverse_cdf64(x, ui)
        if want is not None:
            assert t == want
            checked += 1
    assert checked > 350


def test_draw_never_gives_a_token_without_weight() -> None:
    """-inf (a mask) and logits more than 87 below the row's largest are never drawn, whatever
    the uniform; a row's only finite token always is."""
    x = torch.full((300,), float("-inf"))
    x[[3, 150, 299]] = torch.tensor([0.0, -1.0, -200.0])
    u = [0.0, 0.5, 0.999, 1.0 - 2.0 ** -24]
    tokens, _ = _draw(x, u)
    assert set(tokens.tolist()) <= {3, 150}
    assert tokens[-1] == 150  # the last uniform lands on the last token of any weight
    lone = torch.full((40,), float("-inf"))
    lone[17] = 5.0
    assert _draw(lone, u)[0].tolist() == [17] * 4


# sets of 1-5 tokens close inside the narrow first look (sampling.c's NARROW), of 30 or more
# only inside the wide window
@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (40, 0.95), (5000, 0.7), (1, 1.0), (63, 0.99),
                                         (30, 1.0), (50, 1.0)])
def test_draw_inside_a_window_follows_the_sorted_set(top_k: int, top_p: float) -> None:
    g = torch.Generator().manual_seed(top_k)
    x = torch.randn(5000, generator=g) * 4  # peaked: each set lies within the first window
    sorted_x, order = x.sort(descending=True)
    probs = (sorted_x.double() - sorted_x[0]).exp()
    probs /= probs.sum()
    inside = ((torch.arange(5000) < top_k) & ((probs.cumsum(0) - probs) < top_p))
    inside[0] = True
    assert int(inside.sum()) < 64
    kept = probs * inside
    cdf = kept.cumsum(0) / kept.sum()
    u = torch.rand(300, generator=g)
    tokens, closed = _draw(x, u.tolist(), top_k, top_p)
    assert bool(closed.all())
    for t, ui in zip(tokens.tolist(), u.tolist()):
        if (cdf - ui).abs().min() > 1e-5:
            rank = int(torch.searchsorted(cdf, torch.tensor([ui], dtype=torch.float64), right=True))
            assert t == int(order[rank])
    assert set(tokens.tolist()) <= set(order[inside].tolist())


def test_sets_past_the_window_are_drawn_by_rejection_rounds() -> None:
    """A set wider than the window: the draw takes a token of the whole row and keeps it only
    where it lies in the set; each redraw round drops the rejected token and every one no more
    likely, until a token in the set is kept."""
    flat = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * 0.1
    sorted_x, order = flat.sort(descending=True)
    probs = (sorted_x.double() - sorted_x[0]).exp()
    probs /= probs.sum()
    for top_k, top_p in ((5000, 0.9), (300, 1.0)):  # hundreds of tokens; wider than the kernel
        in_set = torch.zeros(5000, dtype=torch.bool)
        in_set[order[(torch.arange(5000) < top_k) & ((probs.cumsum(0) - probs) < top_p)]] = True
        assert int(in_set.sum()) > 64
        u = torch.rand(400, generator=torch.Generator().manual_seed(2))
        tokens, kept = _draw(flat, u.tolist(), top_k, top_p)
        assert 0 < int(kept.sum()) < 400
        # kept exactly where the token is in the set (but within rounding of its boundary)
        assert (kept == in_set[tokens]).float().mean() > 0.99
        x = flat.expand(400, -1).contiguous()
        pending = (~kept).nonzero().flatten()
        for round_ in range(40):
            if not pending.numel():
                break
            drawn, again = kernels.redraw(x, pending, tokens[pending],
                                          torch.full((len(pending),), top_k),
                                          torch.full((len(pending),), top_p),
                                          torch.zeros(len(pending)), torch.rand(len(pending)))
            assert bool((flat[drawn] > flat[tokens[pending]]).all())  # only likelier ones left
            tokens[pending] = drawn
            pending = pending[~again]
        assert not pending.numel()
        assert in_set[tokens].float().mean() > 0.99
    _, kept = _draw(flat, [0.5], top_k=200)  # top_k alone closes at its rank, in the window
    assert kept.tolist() == [True]


def test_min_p_keeps_the_tokens_within_its_share_of_the_largest() -> None:
    x = torch.full((300,), float("-inf"))
    x[[3, 150, 200, 299]] = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    u = torch.linspace(0, 1 - 2 ** -24, 200).tolist()
    for min_p, top_p, allowed in ((0.2, 1.0, {3, 150, 200}), (0.5, 1.0, {3, 150}),
                                  (1.0, 1.0, {3}), (0.2, 0.8, {3, 150}), (0.0, 1.0, {3, 150, 200, 299})):
        tokens, kept = _draw(x, u, top_p=top_p, min_p=min_p)
        assert bool(kept.all()) and set(tokens.tolist()) == allowed, (min_p, top_p)
    # a wide row: min_p's floor holds through the rejection rounds too
    flat = torch.randn(5000, generator=torch.Generator().manual_seed(4)) * 0.5
    floor = flat.max() + torch.tensor(0.05).log()
    tokens, kept = _draw(flat, torch.rand(300).tolist(), top_p=0.9, min_p=0.05)
    assert bool((flat[tokens] >= floor - 1e-6).all()) and not bool(kept.all())
    assert not kernels.supports_draw(flat.unsqueeze(0).bfloat16())
