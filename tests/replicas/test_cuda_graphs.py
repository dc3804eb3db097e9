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
    graphs = graphed.runner.graphs
    assert graphs is not None and eager.runner.graphs is None
    # every bucket captured when the worker started, before any step
    assert len(graphs.graphs) == len(graphs.batch_buckets) * len(graphs.width_buckets) == 20
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 33)]
    tables = [tuple(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    prefill = StepInput(tuple(RowInput(tuple(p), 0, t, True) for p, t in zip(prompts, tables)))
    for w in (eager, graphed):
        w.execute(prefill)
    lens = [len(p) for p in prompts]
    for step in range(12):
        # ragged batches (5 and 3 rows: not bucket sizes) alternating between the graphs of
        # buckets 8 and 4, which share one pool and one output buffer; a row that does not sample
        live = range(5) if step % 2 == 0 else range(3)
        rows = tuple(RowInput((int(torch.randint(5, 200, (), generator=g)),), lens[i], tables[i],
                              sample=not (step == 2 and i == 1)) for i in live)
        a, b = eager.execute(StepInput(rows)), graphed.execute(StepInput(rows))
        assert a.logits.shape == b.logits.shape == (len(rows) - (step == 2), a.logits.shape[1])
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=1e-4)
        for i in live:
            lens[i] += 1
    # same cache everywhere a sequence lives; padding wrote only into the spare block
    used = BLOCKS * BLOCK
    torch.testing.assert_close(graphed.runner.kv_cache[:, :, :, :used],
                               eager.runner.kv_cache[:, :, :, :used], atol=1e-5, rtol=1e-5)
