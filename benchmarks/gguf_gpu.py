"""How to serve GGUF block weights on a GPU, measured: a linear over the bf16 weights dequantized
once at load (what shardserve does on CUDA) against the same linear dequantizing its raw GGUF
blocks on every call into a workspace (`quant.dequantize`, then the matmul), eager and inside a
CUDA graph (as decode steps replay), with `--compile` also that dequantization fused by
torch.compile into one Triton kernel per weight, and the weights' resident bytes each way.

    python -m benchmarks.gguf_gpu [--rows 1,32,256] [--compile] [--result-json FILE]

Shapes: a Llama-3.2-1B layer (qkv, o, gate_up, down at hidden 2048) and SmolLM2-135M's; Q4_1,
Q8_0 and Q6_K (repacked as quant.Q6). It needs torch and gguf-py alone (no Ray)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from replicas import quant

SHAPES = {"llama-1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
          "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)]}


def _raw(fmt: quant.BlockFormat, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Raw block rows of an [n, k] weight in `fmt` (Q6: random quants under sane scales)."""
    if fmt is quant.Q6:
        raw = torch.randint(0, 256, (n, k // 32, 28), dtype=torch.uint8, generator=g)
        raw[..., :4] = (torch.rand(n, k // 32, 2, generator=g) * 1e-3).half().view(
            torch.uint8).reshape(n, k // 32, 4)
        return raw.reshape(n, -1)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    w = torch.randn(n, k, generator=g).numpy() * 0.02
    return torch.from_numpy(np.ascontiguousarray(quantize(w, GGMLQuantizationType(fmt.ggml_type))))


def _time(fn: Callable[[], Any], graph: bool, repeats: int = 50) -> float:
    """Milliseconds a call, the median of `repeats` after a warm-up (replayed as a CUDA graph)."""
    for _ in range(3):
        fn()
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[len(times) // 2]


def run(rows_list: list[int], compile_models: set[str]) -> list[dict[str, Any]]:
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    out = []
    for model, shapes in SHAPES.items():
        for fmt in (quant.Q4_1, quant.Q8_0, quant.Q6):
            raws = [_raw(fmt, n, k, g).to(device) for n, k in shapes]
            loaded = [quant.dequantize(r, fmt).to(torch.bfloat16) for r in raws]
            fused = torch.compile(lambda r, fmt=fmt: quant.dequantize(r, fmt).to(torch.bfloat16))
            for rows in rows_list:
                xs = [torch.randn(rows, k, device=device, dtype=torch.bfloat16) for _, k in shapes]

                def at_load(xs: list = xs, loaded: list = loaded) -> None:
                    for x, w in zip(xs, loaded):
                        F.linear(x, w)

                def per_call(xs: list = xs, raws: list = raws,
                             fmt: quant.BlockFormat = fmt) -> None:
                    for x, r in zip(xs, raws):
                        F.linear(x, quant.dequantize(r, fmt).to(torch.bfloat16))

                def compiled(xs: list = xs, raws: list = raws, fused: Callable = fused) -> None:
                    for x, r in zip(xs, raws):
                        F.linear(x, fused(r))

                result = {"model": model, "format": fmt.name, "rows": rows,
                          "bf16_bytes": sum(w.numel() * 2 for w in loaded),
                          "raw_bytes": sum(r.numel() for r in raws)}
                for graph in (False, True):
                    tag = "graph" if graph else "eager"
                    result[f"at_load_{tag}_ms"] = _time(at_load, graph)
                    result[f"per_call_{tag}_ms"] = _time(per_call, graph)
                if model in compile_models:
                    try:
                        result["compiled_graph_ms"] = _time(compiled, True)
                    except RuntimeError as exc:  # torch 2.11's inductor mis-shaped Q6's views
                        result["compiled_error"] = f"{type(exc).__name__}: {exc}"
                out.append(result)
                print(f"{model:13s} {fmt.name:5s} rows {rows:4d}: a layer's linears, graph "
                      f"{result['at_load_graph_ms']:.3f} ms at load vs "
                      f"{result['per_call_graph_ms']:.3f} per call "
                      f"({result['per_call_graph_ms'] / result['at_load_graph_ms']:.1f}x); eager "
                      f"{result['at_load_eager_ms']:.3f} vs {result['per_call_eager_ms']:.3f}; "
                      f"weights {result['bf16_bytes'] / 2**20:.0f} vs "
                      f"{result['raw_bytes'] / 2**20:.0f} MiB"
                      + (f"; compiled, graph {result['compiled_graph_ms']:.3f}"
                         if "compiled_graph_ms" in result else "")
                      + (f"; compiled: {result['compiled_error']}"
                         if "compiled_error" in result else ""), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,32,256")
    p.add_argument("--compile", default="", help="models (comma-separated) to also time with "
                   "the dequantization compiled by torch.compile")
    p.add_argument("--result-json", type=Path)
    args = p.parse_args()
    print(torch.cuda.get_device_name(0), flush=True)
    results = run([int(r) for r in args.rows.split(",")],
                  {m for m in args.compile.split(",") if m})
    if args.result_json:
        args.result_json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
