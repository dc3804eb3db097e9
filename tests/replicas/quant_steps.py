"""Multiplies seeded inputs by block-quantized weights with `kernels.linear_q` in a process of its
own, so that `SHARDSERVE_ISA` picks the kernels' build: `python -m tests.replicas.quant_steps OUT`
saves {case: (kernel output, reference)} to OUT, the reference the dequantize-then-matmul product
of x (rounded to bfloat16 in that mode) or, with 8-bit activations, `quant.dot_reference`."""

from __future__ import annotations

import sys

import numpy as np
import torch

# (out features, in features, rows, bias): panels cut short (N not a multiple of any build's
# panel), a single block, the few-row 4-bit path (1-4 rows), row tiles with every tail, past
# a 48-row block (float32: a panel unpacked per block, then a 2-row tail tile)
SHAPES = [(70, 96, 1, False), (50, 576, 2, True), (33, 32, 5, True), (96, 160, 4, False),
          (256, 576, 13, False), (130, 1536, 64, True), (40, 64, 50, False)]


def cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each format and shape in each activation mode the build runs (kernels.QUANT_ACTIVATIONS:
    float32 everywhere, bfloat16 with AVX512-BF16, int8 on the AVX2 and AVX-512 builds)."""
    from replicas import kernels
    lib, out = kernels.load(), {}
    for mode, name in enumerate(kernels.QUANT_ACTIVATIONS):
        if lib.linear_q_set_activations(mode) == mode:
            out |= _cases(name)
    return out


def _cases(activations: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from replicas import kernels, quant
    out = {}
    for fmt in (quant.Q4_0, quant.Q4_1, quant.Q8_0, quant.Q6):
        if (fmt is quant.Q6 and activations != "float32"
                or fmt is quant.Q8_0 and activations == "int8"):
            continue  # 8-bit activations are 4-bit weights' alone; Q6 is float32's
        for n, k, rows, has_bias in SHAPES:
            g = torch.Generator().manual_seed(n * 1000 + k + fmt.ggml_type)
            if fmt is quant.Q6:  # every bit pattern of the quants, sane float16 scales
                raw = torch.randint(0, 256, (n, k // 32, 28), dtype=torch.uint8, generator=g)
                raw[..., :4] = (torch.rand(n, k // 32, 2, generator=g) * 0.02 - 0.01).half() \
                    .view(torch.uint8).reshape(n, k // 32, 4)
                raw = raw.reshape(n, -1)
            else:
                w = torch.randn(n, k, generator=g)
                raw = torch.from_numpy(np.ascontiguousarray(
                    quantize(w.numpy(), GGMLQuantizationType(fmt.ggml_type))))
            x = torch.randn(rows, k, generator=g)
            bias = torch.randn(n, generator=g) if has_bias else None
            packed = quant.pack(raw, fmt, kernels.float32_panel())
            got = kernels.linear_q(x, packed, n, bias)
            if activations == "int8":
                ref = quant.dot_reference(x, raw, fmt) + (0 if bias is None else bias)
            else:
                xr = x.bfloat16().float() if activations == "bfloat16" else x
                ref = torch.nn.functional.linear(xr, quant.dequantize(raw, fmt), bias)
            out[f"{fmt.name} {n}x{k} rows={rows} bias={has_bias} x={activations}"] = (got, ref)
    return out


if __name__ == "__main__":
    torch.save(cases(), sys.argv[1])
