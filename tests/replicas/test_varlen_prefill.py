"""Prefill rows in one varlen flash-attention call against the row-by-row path (GPU only)."""

from __future__ import annotations

import pytest
import torch

from replicas.attention import paged_attention, supports_varlen_prefill
from replicas.model_runner import ModelRunner, RowInput, StepInput

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 128), (32, 8, 64)])
def test_matches_the_row_by_row_path(dtype: torch.dtype, heads: int, kv_heads: int,
                                     dim: int) -> None:
    dev = torch.device("cuda")
    assert supports_varlen_prefill(dtype, dev)
    g = torch.Generator().manual_seed(heads * dim)
    block = 16
    # rows: fresh prompts, a chunk after a cached prefix (not block-aligned), a decode row
    shapes = [(0, 37), (48, 20), (70, 1), (0, 5), (133, 64), (0, 1)]
    perm = torch.randperm(64, generator=g).tolist()
    rows, taken = [], 0
    for start, n in shapes:
        need = -(-(start + n) // block)
        table = tuple(perm[taken:taken + need])
        taken += need
        rows.append(RowInput(tuple(range(n)), start, table, True))
    kv = torch.randn(1, 2, kv_heads, 64 * block, dim, generator=g).to(dev, dtype)
    runner = ModelRunner(None, kv, block)  # type: ignore[arg-type]
    step = StepInput(tuple(rows))
    total = sum(n for _, n in shapes)
    q = torch.randn(total, heads, dim, generator=g).to(dev, dtype)
    k = torch.randn(total, kv_heads, dim, generator=g).to(dev, dtype)
    v = torch.randn(total, kv_heads, dim, generator=g).to(dev, dtype)
    outs = []
    for varlen in (True, False):
        runner.varlen_prefill = varlen
        _, _, meta = runner.prepare(step, runner.update_tables(step))
        assert (meta.prefill_varlen is not None) == varlen
        cache = kv[0].clone()
        outs.append(paged_attention(q, k, v, cache[0], cache[1], meta, dim ** -0.5))
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)


def test_cpu_and_fp32_keep_the_row_by_row_path() -> None:
    assert not supports_varlen_prefill(torch.bfloat16, torch.device("cpu"))
    assert not supports_varlen_prefill(torch.float32, torch.device("cuda"))
