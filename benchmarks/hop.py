"""`bench hop`: what a step costs when the model is split over Ray actors, and what crosses to them.

Times decode steps of `--batch` rows with `--context` tokens each, the same steps three ways: in the
caller's process (tp=1), and at tp=2 (rank 0 in the caller's process as in an engine core, rank 1
on a ShardWorker actor, gloo all-reduces on CPU) sent as the engine sends them, the blocks each
table gained (`model_runner.StepInput`), and with every row's whole table (how steps were sent
before). It also gives the pickled size of each kind of step (what each peer rank receives)."""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

from replicas.embedded import EMBEDDED_MODEL_ID

BLOCK = 16


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=EMBEDDED_MODEL_ID)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=200, help="tokens in each row before the steps")
    p.add_argument("--num-threads", type=int, default=1)


def _steps(batch: int, context: int, steps: int, deltas: bool) -> list[Any]:
    """Decode steps of `batch` rows: each row's table grows by a block every 16 tokens. With
    `deltas`, rows name their sequence and carry only new blocks (the first step: all)."""
    from replicas.model_runner import RowInput, StepInput

    per_row = -(-(context + steps + 1) // BLOCK)
    out = []
    for i in range(steps):
        rows = []
        for r in range(batch):
            pos = context + i
            table = tuple(range(r * per_row, r * per_row + pos // BLOCK + 1))
            if not deltas:
                rows.append(RowInput((7,), pos, table, True))
                continue
            new = table if i == 0 else (table[-1:] if pos % BLOCK == 0 else ())
            rows.append(RowInput((7,), pos, new, True, seq_id=r))
        out.append(StepInput(tuple(rows)))
    return out


def _time(execute: Callable[[Any], Any], steps: list[Any]) -> float:
    times = []
    for i, step in enumerate(steps):
        t = time.perf_counter()
        execute(step)
        if i >= 10:  # warm-up
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def run(args: argparse.Namespace) -> dict[str, float]:
    import ray

    from replicas.executor import InProcessExecutor
    from replicas.model_files import resolve_model_path
    from replicas.ray_executor import RayExecutor
    from replicas.worker import WorkerConfig

    path = str(resolve_model_path(args.model))
    blocks = args.batch * -(-(args.context + args.steps + 1) // BLOCK)

    def config(tp: int) -> WorkerConfig:
        return WorkerConfig(path, "float32", blocks, BLOCK, tp, args.num_threads)

    whole = _steps(args.batch, args.context, args.steps, deltas=False)
    delta = _steps(args.batch, args.context, args.steps, deltas=True)
    out: dict[str, float] = {
        "step_bytes_whole": statistics.mean(len(pickle.dumps(s)) for s in whole[1:]),
        "step_bytes_delta": statistics.mean(len(pickle.dumps(s)) for s in delta[1:])}
    local = InProcessExecutor(config(1))
    out["in_process_ms"] = _time(local.execute, whole)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        ex = RayExecutor(config(2), 0.5, 0.0)
        out["tp2_whole_ms"] = _time(ex.execute, whole)
        out["tp2_delta_ms"] = _time(ex.execute, delta)
        # what rank 0 on an actor would send back each step: the sampling rows' logits
        out["logits_bytes_kept_in_core"] = float(ex.execute(whole[-1]).logits.nbytes)
        ex.shutdown()
    finally:
        ray.shutdown()
    return out


def run_cli(args: argparse.Namespace) -> int:
    for k, v in run(args).items():
        print(f"{k:<26}{v:12.3f}")
    return 0
