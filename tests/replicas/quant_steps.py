"""Multiplies seeded inputs by block-quantized weights with `kernels.linear_q` in a process of its
own, so that `SHARDSERVE_ISA` picks the kernels' build: `python -m tests.replicas.quant_steps OUT`
saves {case: (kernel output, dequantize-then-matmul reference)} to OUT."""

from __future__ import annotations

import sys

import numpy as np
import torch

# (out features, in features, rows, bias): panels cut short (N not a multiple of any build's
# panel), a single block, row tiles with every tail
SHAPES = [(70, 96, 1, False), (33, 32, 5, True), (256, 576, 13, False), (130, 1536, 64, True)]


def cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from replicas import kernels, quant
    out = {}
    for fmt in (quant.Q4_0, quant.Q4_1, quant.Q8_0):
        for n, k, rows, has_bias in SHAPES:
            g = torch.Generator().manual_seed(n * 1000 + k + fmt.ggml_type)
            w = torch.randn(n, k, generator=g)
            raw = torch.from_numpy(np.ascontiguousarray(
                quantize(w.numpy(), GGMLQuantizationType(fmt.ggml_type))))
            x = torch.randn(rows, k, generator=g)
            bias = torch.randn(n, generator=g) if has_bias else None
            packed = quant.pack(raw, fmt, kernels.float32_panel())
            got = kernels.linear_q(x, packed, n, bias)
            ref = torch.nn.functional.linear(x, quant.dequantize(raw, fmt), bias)
            out[f"{fmt.name} {n}x{k} rows={rows} bias={has_bias}"] = (got, ref)
    return out


if __name__ == "__main__":
    torch.save(cases(), sys.argv[1])
