"""Which instruction set the native kernels are built for: chosen once per process from what the
CPU reports, or forced with `SHARDSERVE_ISA` (tests run each path the machine can run).

One C source tree is compiled once per level with that level's target flags: the kernels are
written with GCC vector extensions and intrinsics guarded by the compiler's feature macros, so
each build vectorises for its own registers (16 lanes of float32 on AVX-512, 8 on AVX2, 4 on
NEON and in the portable build's SSE2 or baseline vectors). The levels, best first:

- `avx512_bf16`: AVX-512 with BF16 (and VNNI) dot products (Cooper Lake, Sapphire Rapids and
  later, AMD Zen 4 and later): bf16 compute.
- `avx512`: x86-64-v4 (AVX-512 F/BW/DQ/VL) without BF16: float32 compute.
- `avx2`: x86-64-v3 (AVX2, FMA, F16C, BMI2): float32 compute. Most cloud VMs and laptops.
- `sve`, `neon`: aarch64 with SVE, or Advanced SIMD only (every aarch64 CPU).
- `portable`: the architecture's baseline (x86-64 SSE2, aarch64 without extensions).

`compute_dtype` says what `--dtype auto` computes in on this level: bf16 where the CPU has bf16
dot products, float32 elsewhere (bf16 arithmetic without them costs ~5x float32 in torch)."""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

import torch

ENV = "SHARDSERVE_ISA"

# the compiler's target flags for each level
FLAGS: dict[str, tuple[str, ...]] = {
    "avx512_bf16": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=generic"),
    "avx512": ("-march=x86-64-v4", "-mtune=generic"),
    "avx2": ("-march=x86-64-v3", "-mtune=generic"),
    "sve": ("-march=armv8.2-a+sve+bf16",),
    "neon": ("-march=armv8-a",),
    "portable": (),
}
X86 = ("avx512_bf16", "avx512", "avx2", "portable")
ARM = ("sve", "neon", "portable")

# what /proc/cpuinfo must list for each level (x86-64-v3 and -v4 as the psABI defines them)
_NEEDS = {
    "avx2": {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"},
    "avx512": {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm",
               "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "sve": {"sve", "bf16"},
    "neon": {"asimd"},
}
# every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4) has AVX512-VNNI too
_NEEDS["avx512_bf16"] = _NEEDS["avx512"] | {"avx512_bf16", "avx512_vnni"}


def cpu_flags() -> frozenset[str]:
    """The feature flags the kernel reports for this CPU (x86 `flags`, aarch64 `Features`)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def levels(flags: frozenset[str] | None = None, machine: str | None = None) -> tuple[str, ...]:
    """Every level this CPU runs, best first (`portable` always last)."""
    flags = cpu_flags() if flags is None else flags
    machine = (machine or platform.machine()).lower()
    order = X86 if machine in ("x86_64", "amd64") else ARM if machine in (
        "aarch64", "arm64") else ("portable",)
    return tuple(level for level in order if level == "portable" or _NEEDS[level] <= flags)


@cache
def selected() -> str:
    """The level this process's kernels use: `$SHARDSERVE_ISA` if set (an error if the CPU
    cannot run it), else the best one the CPU runs."""
    runnable = levels()
    forced = os.environ.get(ENV, "").strip().lower()
    if not forced:
        return runnable[0]
    if forced not in FLAGS:
        raise ValueError(f"{ENV}={forced!r}: expected one of {', '.join(FLAGS)}")
    if forced not in runnable:
        raise ValueError(f"{ENV}={forced!r}: this CPU runs only {', '.join(runnable)}")
    return forced


def compute_dtype(level: str | None = None) -> torch.dtype:
    """What a bf16 or fp16 checkpoint computes in on a CPU of this level under `--dtype auto`."""
    return torch.bfloat16 if (level or selected()) in ("avx512_bf16", "sve") else torch.float32
