"""`bench bandwidth`: the memory-bound native kernels against the box's read bandwidth, each on
data far larger than the caches, so that each one's share of the memory system is what it
reaches, not what an L2-resident decode step's tensors would show.

The kernels, at a model's dimensions: paged decode attention (rows x context tokens of cached
keys and values, the decode step's largest read), add + RMSNorm, RoPE with the cache store,
silu * up, and the 4-bit and bf16 linears at one row (a single stream's decode: every weight
read once). Bytes are what each kernel must read plus what it writes, against the read bandwidth
of a sum over 512 MiB (`bench step`'s) measured just before each kernel: these VMs' bandwidth
moves by half from minute to minute. A sum on torch's threads does not always reach the memory
system's peak, and a reused output can stay in the last-level cache, so a kernel that streams
well can show over 100%. Each median is over `--rounds` calls after a warm-up, in one
process."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replicas.embedded import BENCH_MODEL_ID

STREAM_BYTES = 256 << 20  # each case's traffic: far past any cache of these boxes
# kernels that allocate their output are called on row slices whose output stays below glibc's
# largest mmap threshold (32 MiB): larger ones are mapped fresh each call, and the page faults
# of first touching them cost more than the kernel (a served step's tensors are reused heap)
CHUNK_BYTES = 8 << 20


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=BENCH_MODEL_ID, help="an embedded id or an HF folder "
                   "(only its config is read: the data is random)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument("--result-json", type=Path)


def _median_s(fn: Callable[[], Any], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def cases(config: Any, dtype: Any) -> list[tuple[str, int, Callable[[], Any]]]:
    """(name, bytes moved, one call) for each kernel, sized to about STREAM_BYTES."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from benchmarks.linear import layer_shapes, native_linear
    from replicas import host_memory, kernels, quant

    es = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(0)
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    out: list[tuple[str, int, Callable[[], Any]]] = []

    # decode attention: 64 rows, each over its own blocks of a cache this kernel reads once
    rows, block = 64, 16
    context = max(block, STREAM_BYTES // (rows * 2 * kv_heads * head_dim * es) // block * block)
    slots = rows * context
    # in huge pages where the kernel gives them, as the served cache (replicas/host_memory.py)
    k_cache = host_memory.zeros((kv_heads, slots, head_dim), dtype)
    v_cache = host_memory.zeros((kv_heads, slots, head_dim), dtype)
    k_cache.copy_(torch.randn(kv_heads, slots, head_dim, generator=g))
    v_cache.copy_(torch.randn(kv_heads, slots, head_dim, generator=g))
    perm = torch.randperm(slots // block, generator=g)  # scattered blocks, as a served cache's
    tables = perm.view(rows, context // block).to(torch.int64)
    lens = torch.full((rows,), context, dtype=torch.int64)
    q = torch.randn(rows, heads, head_dim, generator=g).to(dtype)
    out.append((f"paged decode attention, {rows} rows x {context} tokens",
                2 * slots * kv_heads * head_dim * es,
                lambda: kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, block,
                                                       head_dim ** -0.5)))
    # one stream's long context: one row over the same caches, cut into layers of 4,000 tokens
    # (a layer's row is a few KV heads' tasks, split into parts: paged_attention.c)
    long = min(4000, slots // block * block)
    layers = slots // long
    tables1 = perm[:layers * (long // block)].view(layers, 1, long // block).to(torch.int64)
    lens1 = torch.tensor([long], dtype=torch.int64)
    q1 = q[:1].contiguous()
    out.append((f"paged decode attention, 1 row x {long} tokens, {layers} layers",
                2 * layers * long * kv_heads * head_dim * es,
                lambda: [kernels.paged_decode_attention(q1, k_cache, v_cache, t, lens1, block,
                                                        head_dim ** -0.5) for t in tables1]))

    # add + RMSNorm: reads x and the residual, writes the residual and the output
    tokens = STREAM_BYTES // (4 * hidden * es)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    residual = torch.randn(tokens, hidden, generator=g).to(dtype)
    norm_weight = torch.ones(hidden, dtype=dtype)
    step = CHUNK_BYTES // (hidden * es)
    out.append((f"add + RMSNorm, {tokens} x {hidden}", 4 * tokens * hidden * es,
                lambda: [kernels.add_rms_norm(x[i:i + step], residual[i:i + step], norm_weight,
                                              1e-5) for i in range(0, tokens, step)]))

    # RoPE + cache store: q and k rotated in place (read + write), v read, k and v stored
    width = heads + 2 * kv_heads
    per_token = (2 * (heads + kv_heads) + kv_heads + 2 * kv_heads) * head_dim * es
    tokens = STREAM_BYTES // per_token
    qkv = torch.randn(tokens, width, head_dim, generator=g).to(dtype)
    angle = torch.rand(tokens, 1, head_dim // 2, generator=g)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    store_k = torch.empty(kv_heads, tokens, head_dim, dtype=dtype)
    store_v = torch.empty_like(store_k)
    slot_mapping = torch.arange(tokens, dtype=torch.int64)
    out.append((f"RoPE + cache store, {tokens} tokens", tokens * per_token,
                lambda: kernels.rope_store(qkv, cos, sin, slot_mapping, store_k, store_v, heads,
                                           kv_heads)))

    # silu(gate) * up: reads [T, 2 inter], writes [T, inter]
    tokens = STREAM_BYTES // (3 * inter * es)
    gate_up = torch.randn(tokens, 2 * inter, generator=g).to(dtype)
    rows_at = CHUNK_BYTES // (inter * es)
    out.append((f"silu * up, {tokens} x {inter}", 3 * tokens * inter * es,
                lambda: [kernels.silu_mul(gate_up[i:i + rows_at])
                         for i in range(0, tokens, rows_at)]))

    # one row through every layer's projections: the weights, read once (a lone stream's decode)
    shapes = layer_shapes(config) * config.num_hidden_layers
    if dtype == torch.float32:
        q4 = []
        for _, n, k in shapes:
            w = torch.randn(n, k, generator=g) * 0.02
            raw = torch.from_numpy(np.ascontiguousarray(quantize(
                w.numpy(), GGMLQuantizationType.Q4_1)))
            q4.append((n, k, quant.pack(raw, quant.Q4_1, kernels.float32_panel())))
        # the weights where the served ones are (one huge-page mapping: host_memory)
        q4 = [(n, k, p) for (n, k, _), p in zip(
            q4, host_memory.tensors_to_huge_pages([p for *_, p in q4]))]
        xs = {k: torch.randn(1, k, generator=g) for _, k, _ in q4}
        out.append((f"Q4_1 linear_q, 1 row, {len(q4)} projections",
                    sum(p.numel() for *_, p in q4),
                    lambda: [kernels.linear_q(xs[k], p, n) for n, k, p in q4]))
    packed = []
    for _, n, k in shapes:
        found = native_linear((torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16), dtype)
        if found is not None:
            packed.append((n, k, *found))
    if packed:
        packed = [(n, k, p, fn) for (n, k, _, fn), p in zip(
            packed, host_memory.tensors_to_huge_pages([p for _, _, p, _ in packed]))]
        xb = {k: torch.randn(1, k, generator=g).to(dtype) for _, k, _, _ in packed}
        name = "linear_mixed" if dtype == torch.float32 else "linear_bf16"
        out.append((f"bf16 weights ({name}), 1 row, {len(packed)} projections",
                    sum(p.numel() * p.element_size() for _, _, p, _ in packed),
                    lambda: [fn(xb[k], p, n) for n, k, p, fn in packed]))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig

    from benchmarks.linear import _cpu_name
    from benchmarks.step import read_bandwidth
    from replicas import kernels
    from replicas.kernels import isa
    from replicas.model_files import resolve_model_path

    if kernels.load() is None:
        raise SystemExit("no native kernels here")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    config = AutoConfig.from_pretrained(resolve_model_path(args.model))
    dtype = getattr(torch, args.dtype)
    rows = []
    for name, nbytes, call in cases(config, dtype):
        bandwidth = read_bandwidth(torch.device("cpu"), gib=0.5)
        seconds = _median_s(call, args.rounds)
        rows.append({"kernel": name, "bytes": nbytes, "ms": seconds * 1e3,
                     "gb_s": nbytes / seconds / 1e9, "read_bandwidth_gb_s": bandwidth / 1e9,
                     "of_bandwidth": nbytes / seconds / bandwidth})
    return {"model": args.model, "dtype": args.dtype, "isa": isa.selected(), "cpu": _cpu_name(),
            "threads": torch.get_num_threads(), "kernels": rows}


def run_cli(args: argparse.Namespace) -> int:
    result = run(args)
    print(f"{result['model']} dimensions, {result['dtype']}, ISA {result['isa']}, "
          f"{result['threads']} threads, {result['cpu']}")
    print(f"{'kernel':<58}{'MB':>8}{'ms':>9}{'GB/s':>8}{'read bw':>9}{'of bw':>8}")
    for r in result["kernels"]:
        print(f"{r['kernel']:<58}{r['bytes'] / 1e6:>8.1f}{r['ms']:>9.2f}{r['gb_s']:>8.1f}"
              f"{r['read_bandwidth_gb_s']:>9.1f}{100 * r['of_bandwidth']:>7.0f}%")
    if args.result_json:
        args.result_json.write_text(json.dumps(result, indent=1))
    return 0
