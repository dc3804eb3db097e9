"""Decode steps replayed through CUDA graphs give the eager forward's logits and cache (GPU only)."""

from __future__ import annotations

import pytest
import torch

from replicas.model_files import resolve_model_path
from replicas.model_runner import RowInput, StepInput
from replicas.worker import ShardWorker, WorkerConfig

pytestmark = pytest.mark.gpu

BLOCKS, BLOCK = 64, 16


def _worker(graphs: bool) -> ShardWorker:
    return ShardWorker(WorkerConfig(str(resolve_model_path("shardserve/tiny-llama")), "float32",
                                    BLOCKS, BLOCK, max_num_seqs=8, max_model_len=256,
                                    cuda_graphs=graphs))


def test_graph_replays_match_the_eager_forward() -> None:
    eager, graphed = _worker(False), _worker(True)
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 33)]
    tables = [tuple(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    prefill = StepInput(tuple(RowInput(tuple(p), 0, t, True) for p, t in zip(prompts, tables)))
    for w in (eager, graphed):
        w.execute(prefill)
    lens = [len(p) for p in prompts]
    for step in range(12):
        # ragged batches (5, then 3 rows: not bucket sizes), one row that does not sample
        live = range(5) if step < 6 else range(3)
        rows = tuple(RowInput((int(torch.randint(5, 200, (), generator=g)),), lens[i], tables[i],
                              sample=not (step == 2 and i == 1)) for i in live)
        a, b = eager.execute(StepInput(rows)), graphed.execute(StepInput(rows))
        assert a.logits.shape == b.logits.shape == (len(rows) - (step == 2), a.logits.shape[1])
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=1e-4)
        for i in live:
            lens[i] += 1
    assert len(graphed.runner.graphs.graphs) >= 2  # batch buckets 8 (5 rows) and 4 (3 rows)
    # same cache everywhere a sequence lives; padding wrote only into the spare block
    used = BLOCKS * BLOCK
    torch.testing.assert_close(graphed.runner.kv_cache[:, :, :, :used],
                               eager.runner.kv_cache[:, :, :, :used], atol=1e-5, rtol=1e-5)
