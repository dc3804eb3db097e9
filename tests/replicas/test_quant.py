"""Block-quantized weights: our dequantization and int8 quantization are gguf-py's (llama.cpp's
reference), and `linear_q` on every ISA build this CPU runs (forced with SHARDSERVE_ISA, one
process each) gives the dequantize-then-matmul product, or with 8-bit activations exactly what
`quant.dot_reference` defines, which stays within a percent of the float product."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from replicas import kernels, quant
from replicas.kernels import isa

ROOT = Path(__file__).resolve().parents[2]
FORMATS = [quant.Q4_0, quant.Q4_1, quant.Q8_0]


def _raw(w: torch.Tensor, fmt: quant.BlockFormat) -> np.ndarray:
    return np.ascontiguousarray(gguf_quantize(w.numpy(), GGMLQuantizationType(fmt.ggml_type)))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dequantize_is_gguf_pys(fmt: quant.BlockFormat) -> None:
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(0)) * 3
    raw = _raw(w, fmt)
    ref = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType(fmt.ggml_type)))
    got = quant.dequantize(torch.from_numpy(raw), fmt)
    assert torch.equal(got, ref.float())
    # and it is w to within a quantization step (4 bits: a 16th of a block's range at most)
    step = w.abs().max() * (1 / 8 if fmt is not quant.Q8_0 else 1 / 127)
    assert (got - w).abs().max() <= step


def test_int8_quantization_rounds_as_llama_cpp() -> None:
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(1))
    w[3, :32] = 0  # an all-zero block: scale 0, no division by it
    assert torch.equal(quant.quantize_q8_0(w), torch.from_numpy(_raw(w, quant.Q8_0)))
    with pytest.raises(ValueError, match="divisible by 32"):
        quant.quantize_q8_0(torch.randn(4, 40))


def test_8bit_activations_stay_close_to_the_float_product() -> None:
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(64, 576, generator=g), torch.randn(4, 576, generator=g)
    for fmt in (quant.Q4_0, quant.Q4_1):
        raw = torch.from_numpy(_raw(w, fmt))
        exact = x @ quant.dequantize(raw, fmt).T
        err = (quant.dot_reference(x, raw, fmt) - exact).abs().max() / exact.abs().max()
        assert err < 0.02, (fmt.name, err)  # measured ~0.5-1% of the largest output


def test_embedding_rows_are_dequantized_as_gathered() -> None:
    w = torch.randn(50, 64, generator=torch.Generator().manual_seed(2))
    raw = torch.from_numpy(_raw(w, quant.Q8_0))
    ids = torch.tensor([[3, 49], [0, 3]])
    full = quant.dequantize(raw, quant.Q8_0)
    assert torch.equal(quant.embedding(ids, raw, quant.Q8_0), full[ids])


@pytest.mark.skipif(kernels.load() is None, reason="no native kernels here")
def test_a_packed_weight_of_another_shape_is_refused() -> None:
    raw = torch.from_numpy(_raw(torch.randn(16, 64), quant.Q4_1))
    packed = quant.pack(raw, quant.Q4_1, kernels.float32_panel())
    with pytest.raises(ValueError, match="not a \\[16, 32\\] weight"):
        kernels.linear_q(torch.randn(2, 32), packed, 16)
    with pytest.raises(ValueError, match="uint8"):
        kernels.linear_q(torch.randn(2, 64).bfloat16(), packed, 16)


@pytest.mark.parametrize("level", list(isa.FLAGS))
def test_every_level_multiplies_every_format(level: str, tmp_path: Path) -> None:
    if level not in isa.levels():
        pytest.skip(f"this CPU does not run {level}")
    out = tmp_path / "quant.pt"
    # every path of the build runs: float32 activations (few-row 4-bit, tiles, unpacked
    # panels), then for 4-bit weights each other mode the build has (bfloat16, int8)
    env = {**os.environ, isa.ENV: level, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "tests.replicas.quant_steps", str(out)], env=env,
                   cwd=ROOT, check=True, timeout=300, capture_output=True)
    results = torch.load(out)
    # 4 formats x 7 shapes, and the 7 shapes again for each format a mode takes: bfloat16 the
    # 4- and 8-bit ones, int8 the 4-bit ones
    bf16_dots = {"bfloat16": 21, "int8": 14}
    modes = {"amx_bf16": bf16_dots, "avx512_bf16": bf16_dots, "avx512": {"int8": 14},
             "avx2": {"int8": 14}}
    assert len(results) == 28 + sum(modes.get(level, {}).values()), sorted(results)
    assert sum(case.startswith("Q6_K") for case in results) == 7, sorted(results)
    for mode, count in modes.get(level, {}).items():
        assert sum(f"x={mode}" in case for case in results) == count, sorted(results)
    for case, (got, ref) in results.items():
        # float32 sums in another order: relative to the output's scale
        torch.testing.assert_close(got, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5,
                                   msg=case)


@pytest.mark.skipif(kernels.load() is None, reason="no native kernels here")
@pytest.mark.parametrize(("asked", "expected"), [
    ("float32", "float32"), ("int8", "int8"), ("auto", None), ("fp8", "one of auto")])
def test_the_activation_mode_comes_from_the_environment(asked: str, expected: str | None) -> None:
    """SHARDSERVE_QUANT_ACTIVATIONS at load: a mode the build runs is taken, `auto` is bfloat16
    on AVX512-BF16 and float32 elsewhere, and a name that is no mode stops the load."""
    level = isa.selected()
    if asked == "int8" and level not in ("amx_bf16", "avx512_bf16", "avx512", "avx2"):
        expected = "float32"  # a build without integer dot products falls back
    if asked == "auto":
        expected = "bfloat16" if level in ("amx_bf16", "avx512_bf16") else "float32"
    code = "from replicas import kernels; print(kernels.quant_activations())"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, kernels.QUANT_ACTIVATIONS_ENV: asked,
                              "PYTHONPATH": str(ROOT)}, timeout=300)
    if expected.startswith("one of"):
        assert run.returncode != 0 and expected in run.stderr, run.stderr
    else:
        assert run.stdout.strip() == expected, run.stderr


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_embedding_rows_come_back_from_packed_panels(fmt: quant.BlockFormat) -> None:
    """A tied head's packed panels serve the embedding: the rows gathered from them are the
    rows gathered from GGUF's (rows past a panel's end, repeated ids, and a prefill's worth,
    gathered a few hundred at a time, included)."""
    g = torch.Generator().manual_seed(4)
    raw = torch.from_numpy(_raw(torch.randn(50, 96, generator=g), fmt))
    for ids in (torch.tensor([[0, 49, 7], [8, 3, 3]]), torch.randint(0, 50, (2, 700), generator=g)):
        for panel in (8, 16):
            packed = quant.pack(raw, fmt, panel)
            assert torch.equal(quant.embedding(ids, packed, fmt), quant.embedding(ids, raw, fmt))
