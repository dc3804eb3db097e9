"""`bench linear`: the native linear kernel against torch's matmul on a model's layer shapes, at
several row counts, alternating in one process (the ratio is what to quote on a noisy machine).

In float32 the kernel is `linear_mixed` over the weights kept as bf16 (what a bf16 checkpoint
runs on CPUs without bf16 dot products) against torch's float32 F.linear (MKL) over the same
values; in bf16 it is `linear_bf16` (AVX512-BF16 builds) against torch's bf16 F.linear. Every
layer of the step is multiplied in turn (each weight from memory, as in a decode step), and the
kernels' ISA build is the one `SHARDSERVE_ISA` or the CPU selects. The box's peak is measured
first with a register-only loop of the same build (`kernels.fma_peak_gflops`: float32 FMAs, or
in bf16 the `vdpbf16ps` dot products, or AMX's tile products in an `amx_bf16` build), and each row
count's share of it reported. On tiles the decode batches are memory-bound (the weights' GB/s
column is then the one to read)."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from replicas.embedded import BENCH_MODEL_ID


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=BENCH_MODEL_ID, help="an embedded id or an HF folder "
                   "(only its config is read: the weights are random)")
    p.add_argument("--rows", default="1,8,32,128,512,2048")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument("--result-json", type=Path)


def layer_shapes(config: Any) -> list[tuple[str, int, int]]:
    """(name, out features, in features) of one decoder layer's projections."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, inter = config.hidden_size, config.intermediate_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    return [("qkv", qkv, hidden), ("o", hidden, config.num_attention_heads * head_dim),
            ("gate_up", 2 * inter, hidden), ("down", hidden, inter)]


def native_linear(weight: Any, dtype: Any) -> tuple[Any, Any] | None:
    """(packed weight, kernel) multiplying bf16 `weight` in `dtype` natively: `linear_mixed` over
    the values kept as bf16 in float32, `linear_bf16` in bf16; None where this build has no such
    kernel."""
    import torch

    from replicas import kernels
    if dtype == torch.float32:
        w = weight.float()
        return (kernels.pack_mixed(w), kernels.linear_mixed) if kernels.packs_mixed(w) else None
    return (kernels.pack_linear(weight), kernels.linear) if kernels.packs_linear(weight) else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig

    from replicas import host_memory, kernels
    from replicas.kernels import isa
    from replicas.model_files import resolve_model_path

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    config = AutoConfig.from_pretrained(resolve_model_path(args.model))
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(config.num_hidden_layers):
        for name, n, k in layer_shapes(config):
            w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
            found = native_linear(w, dtype)
            if found is None:
                raise SystemExit(f"no native {args.dtype} linear on this build ({isa.selected()})")
            packed, native = found
            layers.append((name, n, k, w.to(dtype), packed))
    # both kernels' weights where the served ones are (one huge-page mapping: host_memory)
    moved = iter(host_memory.tensors_to_huge_pages([t for *_, w, p in layers for t in (w, p)]))
    layers = [(name, n, k, next(moved), next(moved)) for name, n, k, _, _ in layers]
    flops_per_row = sum(2 * n * k for _, n, k, _, _ in layers)
    peak = kernels.fma_peak_gflops(dtype=dtype)
    weight_bytes = {"native": sum(p.numel() * p.element_size() for *_, p in layers),
                    "torch": sum(w.numel() * w.element_size() for _, _, _, w, _ in layers)}
    rows_out = []
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in {k for _, _, k, _, _ in layers}}

        def native_pass() -> None:
            for _, n, k, _, packed in layers:
                native(xs[k], packed, n)

        def torch_pass() -> None:
            for _, _, k, w, _ in layers:
                F.linear(xs[k], w)
        times: dict[str, list[float]] = {"native": [], "torch": []}
        for fn in (native_pass, torch_pass):  # warm-up (torch builds its primitives)
            fn()
        for _ in range(args.rounds):
            for label, fn in (("native", native_pass), ("torch", torch_pass)):
                started = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - started)
        med = {label: statistics.median(t) for label, t in times.items()}
        rows_out.append({
            "rows": m, "native_ms": 1e3 * med["native"], "torch_ms": 1e3 * med["torch"],
            "native_gflops": m * flops_per_row / med["native"] / 1e9,
            "torch_gflops": m * flops_per_row / med["torch"] / 1e9,
            "native_weight_gbs": weight_bytes["native"] / med["native"] / 1e9,
            "torch_weight_gbs": weight_bytes["torch"] / med["torch"] / 1e9,
            "speedup": med["torch"] / med["native"],
            "native_of_peak": m * flops_per_row / med["native"] / 1e9 / peak})
    return {"model": args.model, "dtype": args.dtype, "isa": isa.selected(),
            "fma_peak_gflops": peak,
            "cpu": _cpu_name(), "threads": torch.get_num_threads(),
            "layers": config.num_hidden_layers, "rows": rows_out}


def _peak_name(result: dict[str, Any]) -> str:
    if result["dtype"] != "bfloat16":
        return "float32 FMA"
    return "AMX tile" if result["isa"] == "amx_bf16" else "vdpbf16ps"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run_cli(args: argparse.Namespace) -> int:
    result = run(args)
    print(f"{result['model']}: all {result['layers']} layers' projections, {result['dtype']}, "
          f"ISA {result['isa']}, {result['threads']} threads, {result['cpu']}; "
          f"{_peak_name(result)} "
          f"peak {result['fma_peak_gflops']:.1f} GFLOP/s")
    print(f"{'rows':>6}{'native ms':>11}{'torch ms':>10}{'native GF/s':>13}{'torch GF/s':>12}"
          f"{'native GB/s':>13}{'torch GB/s':>12}{'speedup':>9}{'of peak':>9}")
    for r in result["rows"]:
        print(f"{r['rows']:>6}{r['native_ms']:>11.2f}{r['torch_ms']:>10.2f}"
              f"{r['native_gflops']:>13.1f}{r['torch_gflops']:>12.1f}"
              f"{r['native_weight_gbs']:>13.1f}{r['torch_weight_gbs']:>12.1f}"
              f"{r['speedup']:>8.2f}x{100 * r['native_of_peak']:>8.0f}%")
    if args.result_json:
        args.result_json.write_text(json.dumps(result, indent=1))
    return 0
