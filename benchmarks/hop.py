"""`bench hop`: the per-step cost of running the model on shard actors instead of in-process.

Times single-row decode steps of the same model three ways: in the caller's process, on one
ShardWorker actor (tp=1 over Ray), and on two actors (tp=2, gloo on CPU). The difference between
the first two is the actor hop; the third adds the all-reduces."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from replicas.embedded import EMBEDDED_MODEL_ID


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=EMBEDDED_MODEL_ID)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--num-threads", type=int, default=1)


def _time_steps(execute: Any, batch: int, steps: int) -> list[float]:
    from replicas.model_runner import RowInput, StepInput

    times = []
    for i in range(steps + 10):
        step = StepInput(tuple(RowInput((7,), 20 + i, tuple(range(r * 16, r * 16 + 16)), True)
                               for r in range(batch)))
        t = time.perf_counter()
        execute(step)
        if i >= 10:  # warm-up
            times.append(time.perf_counter() - t)
    return times


def run(args: argparse.Namespace) -> dict[str, float]:
    import ray

    from replicas.executor import InProcessExecutor
    from replicas.ray_executor import RayExecutor
    from replicas.model_files import resolve_model_path
    from replicas.worker import WorkerConfig

    path = str(resolve_model_path(args.model))
    blocks = 16 * args.batch + 16

    def config(tp: int) -> WorkerConfig:
        return WorkerConfig(path, "float32", blocks, 16, tp, args.num_threads)

    out: dict[str, float] = {}
    local = InProcessExecutor(config(1))
    out["in_process_ms"] = statistics.median(_time_steps(local.execute, args.batch,
                                                         args.steps)) * 1e3
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        for tp in (1, 2):
            ex = RayExecutor(config(tp), 0.5, 0.0)
            out[f"actors_tp{tp}_ms"] = statistics.median(
                _time_steps(ex.execute, args.batch, args.steps)) * 1e3
            ex.shutdown()
    finally:
        ray.shutdown()
    out["hop_overhead_tp1_ms"] = out["actors_tp1_ms"] - out["in_process_ms"]
    return out


def run_cli(args: argparse.Namespace) -> int:
    for k, v in run(args).items():
        print(f"{k:<22}{v:8.3f}")
    return 0
