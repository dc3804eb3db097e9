"""`bench engine`: offline throughput of the engine alone (no HTTP, no Ray Serve, its core on this
process's event loop rather than in a process of its own), in the shape of
nano-vllm's bench (sequences with input and output lengths uniform in a range, seed 0,
ignore_eos), plus two yardsticks measured in the same run on the same weights:

- the roofline: the time of one decode step's matrix products alone at the batch size, with
  torch's own kernels (the floor for a step of this model on this machine), and
- a single-stream pass: one matrix-vector pass over every weight (the floor for TPOT at batch 1),
- a bare forward over one prompt of the load's mean input length (the floor for TTFT)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.step import read_bandwidth, sync, torch_device_name
from replicas.embedded import BENCH_MODEL_ID

if TYPE_CHECKING:  # the CLI builds its parser without importing torch, Ray or the engine
    from replicas.deployment import LLMServer
    from replicas.request import GenerateRequest


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=BENCH_MODEL_ID)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=100)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply counts and lengths (e.g. 0.125 on a CPU)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-cache-gib", type=float,
                   help="default: on GPUs what --gpu-memory-utilization leaves (as served), on "
                        "CPUs 4")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.6,
                   help="the requests' sampling temperature (0: greedy)")
    p.add_argument("--core", choices=["in-process", "process"], default="in-process",
                   help="process: the engine core in a process of its own, as served (no Ray, "
                        "no HTTP); the floors below are then not measured")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                   help="schedule each step while the one before it runs (default off, as served)")
    p.add_argument("--result-json", type=Path)


def roofline_step_s(server: LLMServer, batch: int, repeats: int = 5) -> float:
    """Time of the matrix products of one decode step at `batch` rows, with torch's kernels."""
    import torch

    from replicas.models.parallel import LINEARS
    model = server.core.engine.executor.worker.runner.model  # type: ignore[attr-defined]
    # the layers' own weights may be packed for the native kernel: torch multiplies copies
    # of their logical shape
    linears = [m for m in model.modules() if isinstance(m, LINEARS)]
    # the compute dtype (the runner's): a block-quantized weight is uint8
    runner = server.core.engine.executor.worker.runner  # type: ignore[attr-defined]
    device, dtype = linears[0].weight.device, runner.dtype
    weights = [torch.randn(m.out_features, m.in_features, dtype=dtype, device=device)
               for m in linears]
    x = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype, device=device)
         for w in weights}
    for w in weights:  # warm-up
        torch.nn.functional.linear(x[w.shape[1]], w)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        for w in weights:
            torch.nn.functional.linear(x[w.shape[1]], w)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def weights_bytes(runner: Any) -> int:
    """The model's weights, as stored (packed, quantized)."""
    return sum(p.numel() * p.element_size() for p in runner.model.parameters())


def prompt_forward_s(server: LLMServer, prompt_len: int, repeats: int = 5) -> float:
    """Median time of one forward (with sampling's logits) over a fresh `prompt_len`-token
    prompt, on the engine's compute thread, straight to the executor: no scheduler, no queue."""
    from replicas.model_runner import RowInput, StepInput

    engine = server.core.engine
    block = engine.blocks.block_size
    # any blocks do: the run is over and this server is not used for anything else after
    table = tuple(range(-(-prompt_len // block)))
    times = []
    for i in range(repeats + 1):
        ids = tuple(10 + (7 * j + i) % 3000 for j in range(prompt_len))
        step = StepInput((RowInput(ids, 0, table, True),))
        t = time.perf_counter()
        engine.compute.submit(engine.executor.execute, step).result()
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t)
    return statistics.median(times)


async def _run(server: LLMServer, reqs: list[GenerateRequest]) -> float:
    async def one(r: GenerateRequest) -> None:
        async for _ in server.generate(r):
            pass
    start = time.perf_counter()
    await asyncio.gather(*(one(r) for r in reqs))
    return time.perf_counter() - start


async def _measure(server: LLMServer, warm: list[GenerateRequest], reqs: list[GenerateRequest]
                   ) -> tuple[dict[str, Any], dict[str, Any], float]:
    """The engine's counters before and after the load, and its seconds (one event loop: a core
    process's client belongs to the loop it started on)."""
    await _run(server, warm)
    before = await server.fresh_stats()
    elapsed = await _run(server, reqs)
    return before, await server.fresh_stats(), elapsed


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from replicas.deployment import LLMServer, ReplicaConfig
    from replicas.request import GenerateRequest, SamplingParams

    s = args.scale
    n = max(1, int(args.num_seqs * s))
    rng = random.Random(args.seed)
    lens = [(rng.randint(int(args.min_input_len * s), int(args.max_input_len * s)),
             rng.randint(int(args.min_output_len * s), int(args.max_output_len * s)))
            for _ in range(n)]
    max_len = max(i + o for i, o in lens) + 1
    in_process = args.core == "in-process"
    server = LLMServer(ReplicaConfig(
        model=args.model, max_model_len=max_len, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_gib=(args.kv_cache_gib if args.kv_cache_gib is not None
                      else None if torch.cuda.is_available() else 4.0),
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.num_threads,
        async_scheduling=args.async_scheduling), in_process=in_process)
    if in_process:  # as the core process does before it serves
        from replicas.heap import freeze_startup_heap
        freeze_startup_heap()
    vocab = min(server.vocab_size, 3900)
    reqs = [GenerateRequest(f"b{k}", tuple(rng.randrange(10, vocab) for _ in range(i)),
                            SamplingParams(max_tokens=o, temperature=args.temperature,
                                           ignore_eos=True))
            for k, (i, o) in enumerate(lens)]
    warm = [GenerateRequest("warm", (11, 12, 13), SamplingParams(max_tokens=4, ignore_eos=True))]
    before, stats, elapsed = asyncio.run(_measure(server, warm, reqs))
    d = {k: stats[k] - before[k] for k in ("num_steps", "decode_steps", "decode_step_s",
                                            "prefill_steps", "prefill_step_s")}
    out_tokens = sum(o for _, o in lens)
    in_tokens = sum(i for i, _ in lens)
    result = {
        "model": args.model, "dtype": server.info()["dtype"],
        "kv_cache_dtype": server.info()["kv_cache_dtype"], "core": args.core,
        "async_scheduling": server.info()["async_scheduling"], "num_seqs": n,
        "input_tokens": in_tokens, "output_tokens": out_tokens, "elapsed_s": elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        "steps": d["num_steps"], "step_ms": 1e3 * elapsed / max(1, d["num_steps"]),
        "decode_only_steps": d["decode_steps"],
        "decode_only_step_ms": 1e3 * d["decode_step_s"] / max(1, d["decode_steps"]),
        "prefill_steps": d["prefill_steps"], "prefill_steps_s": d["prefill_step_s"],
        # the compute thread's share of the load: the rest is the step loop's own work
        "forward_s": d["decode_step_s"] + d["prefill_step_s"]}
    if not in_process:  # the floors need the model in this process
        server.close()
        return result
    batch = min(n, args.max_num_seqs)
    roof = roofline_step_s(server, batch)
    forward = prompt_forward_s(server, round(in_tokens / n))
    runner = server.core.engine.executor.worker.runner  # type: ignore[attr-defined]
    nbytes = weights_bytes(runner)
    result |= {
        "roofline_decode_step_ms_at_batch": roof * 1e3, "roofline_batch": batch,
        "roofline_decode_tokens_per_s": batch / roof,
        # one read of every weight at the device's read bandwidth: one stream's TPOT floor
        "weights_read_ms": 1e3 * nbytes / read_bandwidth(runner.device, gib=0.5),
        "weights_bytes": nbytes,
        "prompt_forward_ms": forward * 1e3, "prompt_forward_len": round(in_tokens / n),
        "threads": torch.get_num_threads(), "device": torch_device_name(runner.device),
    }
    result["fraction_of_roofline"] = result["output_tokens_per_s"] / result[
        "roofline_decode_tokens_per_s"]
    return result


def run_cli(args: argparse.Namespace) -> int:
    result = run(args)
    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k:<{width}}  {v:.2f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    if args.result_json:
        args.result_json.write_text(json.dumps(result, indent=2))
    return 0
