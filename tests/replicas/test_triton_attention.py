"""The Triton decode-attention kernel against the torch gather path (GPU only)."""

from __future__ import annotations

import pytest
import torch

from replicas.attention import decode_attention

pytestmark = pytest.mark.gpu


def _case(heads: int, kv_heads: int, dim: int, block: int, lens: list[int], dtype: torch.dtype,
          seed: int) -> None:
    from replicas.kernels.triton_attention import paged_decode_attention
    g = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda")
    num_blocks = sum(-(-n // block) for n in lens) + 7
    slots = num_blocks * block
    # the caches are one layer's view of a [2, Hkv, slots, D] buffer, as in the worker
    cache = torch.randn(2, kv_heads, slots, dim, generator=g).to(dev, dtype)
    # every row's blocks scattered over the cache in shuffled order
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-n // block) for n in lens)
    tables, taken = [], 0
    for n in lens:
        need = -(-n // block)
        tables.append(order[taken:taken + need] + [0] * (width - need))
        taken += need
    tables_t = torch.tensor(tables, device=dev)
    lens_t = torch.tensor(lens, device=dev)
    # q as a view into a wider qkv tensor (not contiguous over heads), as in the model
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, dim, generator=g).to(dev, dtype)
    q = qkv[:, :heads]
    scale = dim ** -0.5
    out = paged_decode_attention(q, cache[0], cache[1], tables_t, lens_t, block, scale)
    # reference: gather each row's keys densely, mask past its length, float32 softmax
    index = (tables_t.unsqueeze(-1) * block + torch.arange(block, device=dev)).flatten(1)
    kd = cache[0][:, index]  # [Hkv, B, K, D]
    vd = cache[1][:, index]
    mask = (torch.arange(index.shape[1], device=dev) < lens_t.unsqueeze(1))[:, None, None, :]
    ref = decode_attention(q.contiguous(), kd, vd, mask, scale)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(9, 3, 64), (32, 8, 64), (8, 8, 128), (12, 2, 80)])
def test_matches_the_gather_path(dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> None:
    # lengths: one key, inside one tile, exactly a tile, past several tiles and blocks
    _case(heads, kv_heads, dim, 16, [1, 7, 64, 65, 200, 513], dtype, seed=heads + dim)


def test_block_sizes_other_than_16() -> None:
    _case(9, 3, 64, 32, [5, 33, 300], torch.bfloat16, seed=1)
    _case(9, 3, 64, 8, [3, 70], torch.bfloat16, seed=2)
