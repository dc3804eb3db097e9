"""The aarch64 builds of the native kernels (`neon`, `sve`), compiled with a cross compiler and run
under qemu-user on an x86 box, against torch on the host: the ISA levels this machine cannot run
natively still compute what the x86 ones do. Each call goes through `kernel_call.c` (a small
aarch64 program that loads the library and calls one function with buffers from files).

Needs `aarch64-linux-gnu-gcc` and `qemu-aarch64` (Debian: gcc-aarch64-linux-gnu, qemu-user);
skipped where they are missing, and on aarch64 hosts, where the other tests run these levels
natively. Emulation measures nothing about speed: correctness only."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from replicas import kernels, quant
from replicas.models.rope import apply_rotary
from tests.replicas.k_quants import q6_k
from tests.replicas.test_kernels import BLOCK, _case, _reference

CC, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", Path("/usr/aarch64-linux-gnu")
# the CPU qemu emulates for each level: an Armv8.0 core (NEON only), and one with SVE and BF16
CPUS = {"neon": "cortex-a57", "sve": "max"}
THREADS = 2  # the kernels' parallel paths, as on the 2-core boxes

pytestmark = pytest.mark.skipif(
    platform.machine().lower() in ("aarch64", "arm64") or not shutil.which(CC)
    or not shutil.which(QEMU), reason="needs an x86 host with aarch64-linux-gnu-gcc and qemu-aarch64")


class Cross:
    """One aarch64 build of the kernel library and the program that calls into it."""

    def __init__(self, level: str, lib: Path, driver: Path, work: Path) -> None:
        self.level, self.lib, self.driver, self.work = level, lib, driver, work
        self.calls = 0

    def __call__(self, name: str, *args: Any, ret: str = "i") -> tuple[float, list[torch.Tensor]]:
        """Calls `name` with args (tensors as buffers, None as NULL, ints, floats); returns its
        return value and every tensor argument as the call left it."""
        self.calls += 1
        argv, tensors = [], []
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                path = self.work / f"{self.calls}-{i}.bin"
                path.write_bytes(arg.contiguous().view(torch.uint8).numpy().tobytes())
                argv.append(f"b:{path}")
                tensors.append((path, arg))
            elif arg is None:
                argv.append("n")
            elif isinstance(arg, float):
                argv.append(f"f:{arg!r}")
            else:
                argv.append(f"i:{int(arg)}")
        done = subprocess.run([QEMU, "-L", str(SYSROOT), "-cpu", CPUS[self.level],
                               str(self.driver), str(self.lib), name, ret, *argv],
                              capture_output=True, text=True, timeout=300,
                              env={"OMP_NUM_THREADS": str(THREADS)})
        assert done.returncode == 0, done.stderr
        out = [torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
               .view(t.dtype).reshape(t.shape) for path, t in tensors]
        return float(done.stdout), out


@pytest.fixture(scope="module", params=list(CPUS))
def cross(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Cross:
    level = request.param
    work = tmp_path_factory.mktemp(f"cross-{level}")
    lib = kernels.build(CC, level, [])
    driver = work / "kernel_call"
    subprocess.run([CC, "-O1", str(Path(__file__).with_name("kernel_call.c")), "-o", str(driver),
                    "-ldl"], check=True, capture_output=True, timeout=120)
    return Cross(level, lib, driver, work)


def test_the_build_is_for_aarch64_and_runs_fma_loops(cross: Cross) -> None:
    assert int.from_bytes(cross.lib.read_bytes()[18:20], "little") == 183  # EM_AARCH64
    flops, _ = cross("fma_peak", 1000, THREADS, ret="d")
    assert flops == 2 * 4 * 12 * 1000 * THREADS  # 4 float32 lanes, 12 chains, per thread
    assert cross("linear_bf16_fast")[0] == 0  # bf16 linears are AVX512-BF16's alone
    assert cross("linear_mixed_panel")[0] == 8  # two 4-lane vectors


@pytest.mark.parametrize("rows", [1, 7, 9, 50])
@pytest.mark.parametrize("n,k", [(13, 70), (40, 96)])
def test_linear_mixed(cross: Cross, rows: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(rows * n)
    w = torch.randn(n, k, generator=g).bfloat16().float()
    x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    packed = kernels.pack_mixed(w, panel=8)
    out = torch.empty(rows, n)
    failed, (*_, got) = cross("linear_mixed", x, packed, bias, out, rows, n, k, THREADS)
    assert failed == 0
    torch.testing.assert_close(got, F.linear(x, w, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", [quant.Q4_0, quant.Q4_1, quant.Q8_0, quant.Q6],
                         ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [1, 3, 9, 50])  # decode rows, a tile and a tail, row blocks
def test_linear_q(cross: Cross, fmt: quant.BlockFormat, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    n, k = 21, 256  # rows of the weight not a multiple of the panel
    w = torch.randn(n, k, generator=g).numpy()
    raw = torch.from_numpy(np.ascontiguousarray(gguf_quantize(
        w, GGMLQuantizationType(fmt.ggml_type)) if fmt is not quant.Q6 else q6_k(w)))
    if fmt is quant.Q6:
        raw = quant.q6_k_to_q6(raw)
    x = torch.randn(rows, k, generator=g)
    out = torch.empty(rows, n)
    failed, (*_, got) = cross("linear_q", x, quant.pack(raw, fmt, 8), None, out, rows, n, k,
                              THREADS)
    assert failed == 0
    torch.testing.assert_close(got, x @ quant.dequantize(raw, fmt).T, atol=1e-4, rtol=1e-4)


DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("suffix", [*DTYPES, "f32_bf16kv"])
def test_paged_decode_attention(cross: Cross, suffix: str) -> None:
    dtype = DTYPES[suffix.split("_")[0]]
    q, k_cache, v_cache, tables, lens = _case(torch.bfloat16 if suffix.endswith("kv") else dtype,
                                              6, [1, 16, 17, 40, 3])
    q = q.to(dtype)  # (f32_bf16kv: float32 queries over a bf16 cache)
    b, h, d = q.shape
    out = torch.empty_like(q)
    failed, (*_, got) = cross(f"paged_decode_attention_{suffix}", q, k_cache, v_cache,
                              tables.long(), lens.long(), out, b, h, k_cache.shape[0], d,
                              k_cache.shape[1] // BLOCK, BLOCK, tables.shape[1], 0.3, THREADS)
    assert failed == 0
    torch.testing.assert_close(got.double(), _reference(q, k_cache, v_cache, tables, lens, 0.3),
                               atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)


@pytest.mark.parametrize("suffix", list(DTYPES))
def test_add_rms_norm_rope_store_and_silu_mul(cross: Cross, suffix: str) -> None:
    dtype = DTYPES[suffix]
    g = torch.Generator().manual_seed(5)
    x, residual = (torch.randn(70, 96, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(96, generator=g).to(dtype)
    out = torch.empty_like(x)
    _, (_, summed, _, normed) = cross(f"add_rms_norm_{suffix}", x, residual, weight, 1e-6, out,
                                      70, 96, THREADS)
    total = (x + residual).float()
    ref = weight * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, ref, atol=1e-5 if dtype == torch.float32 else 0, rtol=0)

    heads, kv_heads, dim, slots, tokens = 6, 2, 64, 256, 37
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    angles = torch.rand(tokens, 1, dim // 2, generator=g) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slot_mapping = torch.randperm(slots, generator=g)[:tokens]
    k_cache, v_cache = (torch.randn(kv_heads, slots, dim, generator=g).to(dtype) for _ in "kv")
    rotated = apply_rotary(qkv[:, :heads + kv_heads], cos, sin)
    _, (got_qkv, *_, got_k, got_v) = cross(
        f"rope_store_{suffix}", qkv, cos, sin, slot_mapping, k_cache, v_cache, tokens, heads,
        kv_heads, dim, slots, THREADS)
    torch.testing.assert_close(got_qkv[:, :heads + kv_heads], rotated, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k[:, slot_mapping], rotated[:, heads:].transpose(0, 1),
                               atol=1e-6, rtol=1e-6)
    assert torch.equal(got_v[:, slot_mapping], qkv[:, heads + kv_heads:].transpose(0, 1))

    gated = (torch.randn(9, 2 * 200, generator=g) * 4).to(dtype)
    out = gated.new_empty(9, 200)
    _, (_, got) = cross(f"silu_mul_{suffix}", gated, out, 9, 200, THREADS)
    gate, up = gated.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    # as the host's test: exp may differ in the last float32 bit, one bf16 ulp after rounding
    tol = torch.finfo(dtype).eps * ref.abs().float().clamp_min(1e-30) * 1.01
    assert ((got - ref).abs().float() <= tol + (1e-6 if dtype == torch.float32 else 0)).all()


def test_topk_and_draw(cross: Cross) -> None:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 5000, generator=g) * 4
    x[1, ::3] = float("-inf")
    _, (_, values, indices) = cross("topk_f32", x, 3, 5000, 64, torch.empty(3, 64),
                                    torch.empty(3, 64, dtype=torch.int64), THREADS)
    want_values, want_indices = x.topk(64, dim=-1)
    assert torch.equal(values, want_values) and torch.equal(indices, want_indices)
    x[2, [900, 4000]] = 30.0  # ties: the first
    _, (_, best) = cross("argmax_f32", x, 3, 5000, torch.empty(3, dtype=torch.int64), THREADS)
    assert best.tolist() == x.argmax(-1).tolist() and best[2] == 900
    tokens = torch.tensor([5, 1, 4000])
    _, (*_, chosen, ranks, values, ids) = cross(
        "logprobs_f32", x, 3, 5000, tokens, 5, torch.empty(3), torch.empty(3, dtype=torch.int64),
        torch.empty(3, 5), torch.empty(3, 5, dtype=torch.int64), THREADS)
    ref = x.log_softmax(-1)
    torch.testing.assert_close(chosen, ref.gather(1, tokens.unsqueeze(1)).squeeze(1), atol=2e-5,
                               rtol=0)
    assert ranks.tolist() == ((x > x.gather(1, tokens.unsqueeze(1))).sum(1) + 1).tolist()
    torch.testing.assert_close(values, ref.topk(5, dim=-1).values, atol=2e-5, rtol=0)

    # 40 draws of each row: the whole row, top_p 0.9, top_k 20
    rows = 3 * 40
    xs, us = x.repeat_interleave(40, 0), torch.rand(rows, generator=g)
    top_k = torch.tensor([5000, 5000, 20]).repeat_interleave(40)
    top_p = torch.tensor([1.0, 0.9, 1.0]).repeat_interleave(40)
    min_p = torch.zeros(rows)
    _, (*_, tokens, closed) = cross("draw_f32", xs, rows, 5000, 64, top_k, top_p, min_p, us,
                                    torch.empty(rows, dtype=torch.int64),
                                    torch.empty(rows, dtype=torch.uint8), THREADS)
    host_tokens, host_closed = kernels.draw(xs, top_k, top_p, min_p, us, 64)
    assert torch.equal(closed.bool(), host_closed) and bool(host_closed.all())
    # the same draws as this machine's build, but where a uniform lies within rounding of a
    # boundary (the sums' order follows the vector width)
    assert (tokens == host_tokens).float().mean() > 0.97
    assert not bool(torch.isinf(xs.gather(1, tokens.unsqueeze(1))).any())

    # a flat row's top_p set (min_p 0.01 too), past the window: drawn from the whole row, then a
    # rejection round
    flat = (torch.randn(1, 5000, generator=g) * 0.1).expand(40, -1).contiguous()
    k, p, mp = torch.full((40,), 5000), torch.full((40,), 0.9), torch.full((40,), 0.01)
    u, again = torch.rand(40, generator=g), torch.rand(40, generator=g)
    _, (*_, tokens, kept) = cross("draw_f32", flat, 40, 5000, 64, k, p, mp, u,
                                  torch.empty(40, dtype=torch.int64),
                                  torch.empty(40, dtype=torch.uint8), THREADS)
    host_tokens, host_kept = kernels.draw(flat, k, p, mp, u, 64)
    assert (tokens == host_tokens).float().mean() > 0.9 and 0 < int(host_kept.sum()) < 40
    at = (~host_kept).nonzero().flatten()
    _, (*_, redrawn, _) = cross("redraw_f32", flat, len(at), 5000, at, k[at], p[at], mp[at],
                                again[at], host_tokens[at],
                                torch.empty(len(at), dtype=torch.uint8), THREADS)
    host_redrawn, _ = kernels.redraw(flat, at, host_tokens[at], k[at], p[at], mp[at], again[at])
    assert (redrawn == host_redrawn).float().mean() > 0.9


def test_penalties(cross: Cross) -> None:
    g = torch.Generator().manual_seed(12)
    x = torch.randn(4, 700, generator=g) * 5
    ids = torch.randint(0, 90, (4, 150), generator=g)
    ids[1, 100:] = -1  # padding
    lens, starts = torch.tensor([150, 100, 150, 0]), torch.tensor([20, 50, 150, 0])
    rep, freq, pres = (torch.tensor([1.3, 0.8, 1.0, 1.2]), torch.tensor([0.4, -0.2, 0.9, 0.0]),
                       torch.tensor([0.5, 1.1, 0.0, 0.3]))
    failed, (got, *_) = cross("penalize_f32", x, 4, 700, ids, 150, lens, starts, rep, freq, pres,
                              THREADS)
    want = x.clone()
    kernels.penalize(want, ids, lens, starts, rep, freq, pres)
    assert failed == 0 and torch.equal(got, want) and not torch.equal(got, x)


def test_bitmask(cross: Cross) -> None:
    from structured.bitmask import apply_bitmask
    g = torch.Generator().manual_seed(13)
    x = torch.randn(3, 1000, generator=g)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 30), dtype=torch.int32, generator=g)
    mask[:, 0], mask[:, 1] = -1, 0
    _, (got, *_) = cross("bitmask_f32", x, 1000, mask, 30, torch.tensor([0, 2]), 2, THREADS)
    want = x.clone()
    apply_bitmask(want, mask, [0, 2])
    assert torch.equal(got, want)
