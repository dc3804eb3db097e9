"""Steps replayed through CUDA graphs, decode-only and mixed with prompt chunks, give the eager
forward's logits and cache (GPU only)."""

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
                                    cuda_graphs=graphs, max_num_batched_tokens=64))


def test_graph_replays_match_the_eager_forward() -> None:
    eager, graphed = _worker(False), _worker(True)
    graphs = graphed.runner.graphs
    assert graphs is not None and eager.runner.graphs is None
    # every bucket captured when the worker started, before any step: steps of up to 64 tokens
    # (the step budget; mixed steps through the Triton kernel) at 5 table widths
    assert graphs.mixed and graphs.max_tokens == 64
    assert len(graphs.graphs) == len(graphs.batch_buckets) * len(graphs.width_buckets) == 45
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


def test_mixed_steps_replay_and_match_the_eager_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    eager, graphed = _worker(False), _worker(True)
    replayed: list[int] = []
    run = graphed.runner.graphs.run

    def spy(ids, *args):  # noqa: ANN001, ANN202
        replayed.append(len(ids))
        return run(ids, *args)

    monkeypatch.setattr(graphed.runner.graphs, "run", spy)
    g = torch.Generator().manual_seed(1)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(5, 200, (n,), generator=g).tolist())

    a, b, c, d = tokens(20), tokens(9), tokens(55), tokens(5)
    table = {name: tuple(range(i * 8, i * 8 + 8)) for i, name in enumerate("abcd")}
    steps = [
        # two prompts from scratch (29 tokens)
        (RowInput(a, 0, table["a"], True, seq_id=0), RowInput(b, 0, table["b"], True, seq_id=1)),
        # decode rows beside a chunk that does not sample and a prompt asking for its logprobs
        (RowInput(tokens(1), 20, (), True, seq_id=0), RowInput(tokens(1), 9, (), True, seq_id=1),
         RowInput(c[:30], 0, table["c"], False, seq_id=2),
         RowInput(d, 0, table["d"], True, all_logits=True, seq_id=3)),
        # the chunk after a cached prefix of 30 (its keys cross blocks), beside decode rows
        (RowInput(tokens(1), 21, (), True, seq_id=0), RowInput(c[30:], 30, (), True, seq_id=2),
         RowInput(tokens(1), 5, (), True, seq_id=3)),
        # too many tokens for the graphs (65 > 64): eager in both
        (RowInput(tokens(64), 22, (), True, seq_id=0), RowInput(tokens(1), 10, (), True,
                                                               seq_id=1)),
    ]
    for rows in steps:
        want, got = eager.execute(StepInput(rows)), graphed.execute(StepInput(rows))
        assert got.logits.shape == want.logits.shape
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
        for x, y in zip(want.all_logits, got.all_logits):
            assert (x is None) == (y is None)
            if x is not None:
                torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-4)
    assert replayed == [29, 37, 27]  # the first three steps replayed, the last ran eagerly
    used = BLOCKS * BLOCK
    torch.testing.assert_close(graphed.runner.kv_cache[:, :, :, :used],
                               eager.runner.kv_cache[:, :, :, :used], atol=1e-5, rtol=1e-5)
