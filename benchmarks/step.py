"""`bench step`: the model's decode step alone (one ShardWorker: no engine loop, no Ray) at several
batch sizes, on the device the worker picks (the GPU when there is one), against the memory-bandwidth
bound measured in the same run: the bytes a step must read (every weight once, plus each row's
cached keys and values) over the device's read bandwidth. It imports neither Ray nor the serving
stack, so it runs on a bare GPU machine with torch and transformers alone."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from replicas.embedded import BENCH_MODEL_ID


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=BENCH_MODEL_ID,
                   help="an embedded id (shardserve/bench-135m, shardserve/bench-1b) or a folder")
    p.add_argument("--batch-sizes", default="1,8,32,64,128")
    p.add_argument("--context", type=int, default=512, help="cached tokens per row")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="as the server's flag: auto is what the server computes in on this device")
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="as the server's flag")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (as vLLM's flag)")
    p.add_argument("--small-pages-peer", action="store_true",
                   help="on CPUs, also step a second copy of the model whose weights sit where "
                        "torch's allocator puts them (4 KB pages), alternating with the served "
                        "layout (one huge-page mapping: replicas/host_memory.py)")
    p.add_argument("--interferers", type=int, default=0,
                   help="on CPUs, also step beside this many processes that take the CPU in "
                        "bursts, as the serving stack does (benchmarks/interference.py), "
                        "alternating blocks of steps with them paused and running")
    p.add_argument("--interferer-burst-us", type=float, default=60.0)
    p.add_argument("--interferer-period-us", type=float, default=1200.0)
    p.add_argument("--interferer-nice", type=int, default=0,
                   help="their niceness (the served core runs at 5, Serve's replicas at 15, "
                        "Ray's daemons at 0)")
    p.add_argument("--result-json", type=Path)


def sync(device: Any) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


def read_bandwidth(device: Any, gib: float = 1.0) -> float:
    """Bytes per second read by a sum over a tensor far larger than the caches (the median of 7
    after a warm-up): a reduction writes nothing back, as a decode step's weight reads do not. (A
    copy's read + write rate halved underestimates it on CPUs: 25.5 against 32.8 GB/s on the
    project's Zen 4 box.) On CPUs the tensor is on huge pages, as the served weights are
    (replicas/host_memory.py): the box's read rate, which on 4 KB pages it is not (a sum over
    512 MB on the project's Zen 4: 42-47 GB/s on 4 KB pages, 52-62 on 2 MB pages, alternating)."""
    import torch
    numel = int(gib * 2**30) // 4
    if device.type == "cpu":
        from replicas import host_memory
        a = host_memory.zeros((numel,), torch.float32)
    else:
        a = torch.ones(numel, device=device)
    times = []
    for _ in range(8):
        sync(device)
        t = time.perf_counter()
        a.sum()
        sync(device)
        times.append(time.perf_counter() - t)
    return a.numel() * a.element_size() / sorted(times[1:])[3]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig

    from replicas import kv_budget
    from replicas.engine_core import resolve_dtypes
    from replicas.model_files import resolve_model_path
    from replicas.worker import ShardWorker, WorkerConfig

    batches = [int(b) for b in args.batch_sizes.split(",")]
    block = 16
    blocks_per_row = args.context // block + 1
    path = resolve_model_path(args.model)
    dtype, kv_dtype = resolve_dtypes(args.dtype, args.kv_cache_dtype, path,
                                     AutoConfig.from_pretrained(path), torch.cuda.is_available())
    worker_config = WorkerConfig(str(path), dtype,
                                 max(batches) * blocks_per_row + 1, block,
                                 num_threads=args.num_threads, max_num_seqs=max(batches),
                                 max_model_len=args.context + block,
                                 cuda_graphs=not args.enforce_eager,
                                 kv_cache_dtype=kv_dtype)
    worker = ShardWorker(worker_config)
    model, device = worker.runner.model, worker.device
    peer = None
    if args.small_pages_peer and device.type == "cpu":
        peer = ShardWorker(worker_config)
        for p in peer.runner.model.parameters():  # each weight a torch allocation of its own
            p.data = p.data.clone()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = kv_budget.kv_bytes_per_token(
        config.num_hidden_layers, config.num_key_value_heads, head_dim,
        worker.runner.kv_cache.element_size())
    bandwidth = read_bandwidth(device)
    interferers = None
    if args.interferers:
        if device.type != "cpu":
            raise SystemExit("--interferers is for CPUs: a GPU step does not share its cores")
        from benchmarks.interference import Interferers
        interferers = Interferers(args.interferers, args.interferer_burst_us / 1e6,
                                  args.interferer_period_us / 1e6, args.interferer_nice)
    try:
        return _steps(args, worker, peer, bandwidth, kv_bytes_per_token, interferers, {
            "model": args.model, "device": torch_device_name(device), "dtype": dtype,
            "kv_cache_dtype": kv_dtype, "cuda_graphs": worker.runner.graphs is not None,
            "parameters": sum(p.numel() for p in model.parameters()),
            "weight_bytes": weight_bytes, "read_bandwidth_gb_s": bandwidth / 1e9,
            "context": args.context, "steps": {}})
    finally:
        if interferers is not None:
            interferers.close()


def _steps(args: argparse.Namespace, worker: Any, peer: Any, bandwidth: float,
           kv_bytes_per_token: int, interferers: Any, out: dict[str, Any]) -> dict[str, Any]:
    """Each batch size's steps, timed (beside the interferers too where there are some)."""
    from replicas.model_runner import RowInput, StepInput

    device, weight_bytes = worker.device, out["weight_bytes"]
    blocks_per_row = args.context // worker.config.block_size + 1
    for b in (int(b) for b in args.batch_sizes.split(",")):
        tables = [tuple(range(i * blocks_per_row + 1, (i + 1) * blocks_per_row + 1))
                  for i in range(b)]
        step = StepInput(tuple(RowInput((5,), args.context, tables[i], True) for i in range(b)))
        workers = [worker] if peer is None else [worker, peer]
        for w in workers:
            for _ in range(3):
                w.execute(step)
        sync(device)
        times: list[list[float]] = [[] for _ in workers]

        def timed(w: Any) -> float:
            t = time.perf_counter()
            w.execute(step)
            sync(device)
            return time.perf_counter() - t

        def alternating() -> None:  # the box's drift hits every worker alike
            for w, acc in zip(workers, times):
                acc.append(timed(w))
        beside: list[float] = []
        if interferers is None:
            for _ in range(args.repeats):
                alternating()
        else:
            # blocks of ~0.1 s with them paused, then running (in turn first), so that a block
            # sees many of their bursts and the drift of the box falls on both
            block = max(1, int(0.1 / max(timed(worker), 1e-4)))
            mark = interferers.mark()
            for r in range(-(-args.repeats // block)):
                for running in ((False, True) if r % 2 == 0 else (True, False)):
                    (interferers.run if running else interferers.pause)()
                    for _ in range(block):
                        if running:
                            beside.append(timed(worker))
                        else:
                            alternating()
            interferers.pause()
            share = interferers.share(mark)
            beside.sort()
        for acc in times:
            acc.sort()
        # reading each weight once and each row's cache once
        bound = (weight_bytes + b * args.context * kv_bytes_per_token) / bandwidth
        median = times[0][len(times[0]) // 2]
        out["steps"][b] = {"median_ms": median * 1e3, "min_ms": times[0][0] * 1e3,
                           "bandwidth_bound_ms": bound * 1e3,
                           "bound_over_step": bound / median,
                           "tokens_per_s": b / median}
        if peer is not None:
            out["steps"][b]["small_pages_median_ms"] = times[1][len(times[1]) // 2] * 1e3
        if beside:
            slower = beside[len(beside) // 2] / median
            # at ideal packing a compute-bound step takes 1 / (1 - share) as long
            out["steps"][b].update({"beside_interferers_median_ms": beside[len(beside) // 2] * 1e3,
                                    "interferers_share": share, "beside_over_alone": slower,
                                    "loss_over_share": (slower - 1) / (share / (1 - share))
                                    if share else None})
    return out


def torch_device_name(device: Any) -> str:
    import torch
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def run_cli(args: argparse.Namespace) -> int:
    result = run(args)
    print(f"{result['model']} on {result['device']}: {result['parameters'] / 1e6:.0f}M parameters, "
          f"{result['weight_bytes'] / 1e9:.2f} GB of weights; read bandwidth "
          f"{result['read_bandwidth_gb_s']:.1f} GB/s; {result['dtype']} over a "
          f"{result['kv_cache_dtype']} KV cache; context {args.context}; "
          f"CUDA graphs {'on' if result['cuda_graphs'] else 'off'}")
    peer = any("small_pages_median_ms" in r for r in result["steps"].values())
    beside = any("beside_interferers_median_ms" in r for r in result["steps"].values())
    if beside:
        print(f"interferers: {args.interferers} at niceness {args.interferer_nice}, each "
              f"{args.interferer_burst_us:g} us of CPU every {args.interferer_period_us:g} us; "
              "'their share': their CPU while running, of the whole box; 'loss / share': the "
              "step's loss over what ideal packing would lose to that share")
    print(f"{'batch':>6} {'step p50 ms':>12} {'min ms':>8} {'bound ms':>9} {'bound/step':>11} "
          f"{'tok/s':>9}" + (f" {'4 KB pages p50 ms':>18} {'4 KB / huge':>12}" if peer else "")
          + (f" {'beside p50 ms':>14} {'their share':>12} {'beside/alone':>13} "
             f"{'loss / share':>13}" if beside else ""))
    for b, r in result["steps"].items():
        line = (f"{b:>6} {r['median_ms']:>12.2f} {r['min_ms']:>8.2f} "
                f"{r['bandwidth_bound_ms']:>9.2f} {r['bound_over_step']:>11.2f} "
                f"{r['tokens_per_s']:>9.0f}")
        if peer:
            small = r["small_pages_median_ms"]
            line += f" {small:>18.2f} {small / r['median_ms']:>11.2f}x"
        if beside:
            ratio = r["loss_over_share"]
            line += (f" {r['beside_interferers_median_ms']:>14.2f} "
                     f"{100 * r['interferers_share']:>11.1f}% {r['beside_over_alone']:>12.3f}x "
                     + (f"{ratio:>13.2f}" if ratio is not None else f"{'-':>13}"))
        print(line)
    if args.result_json:
        args.result_json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":  # `python -m benchmarks.step` on a machine without the serving stack
    import sys
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step", description=__doc__)
    add_cli_args(parser)
    sys.exit(run_cli(parser.parse_args()))
