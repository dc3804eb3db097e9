"""Which instruction set the native kernels are built for: chosen once per process from what the
CPU reports, or forced with `SHARDSERVE_ISA` (tests run each path the machine can run).

One C source tree is compiled once per level with that level's target flags: the kernels are
written with GCC vector extensions and intrinsics guarded by the compiler's feature macros, so
each build vectorises for its own registers (16 lanes of float32 on AVX-512, 8 on AVX2, 4 on
NEON and in the portable build's SSE2 or baseline vectors). The levels, best first:

- `amx_bf16`: `avx512_bf16` plus AMX's bf16 tile multiply (Sapphire Rapids and later Xeons),
  where Linux grants the process the tile state (5.16 and later): bf16 compute, the linears on
  tiles.
- `avx512_bf16`: AVX-512 with BF16 (and VNNI) dot products (Cooper Lake, Sapphire Rapids and
  later, AMD Zen 4 and later): bf16 compute.
- `avx512`: x86-64-v4 (AVX-512 F/BW/DQ/VL) without BF16: float32 compute.
- `avx2`: x86-64-v3 (AVX2, FMA, F16C, BMI2): float32 compute. Most cloud VMs and laptops.
- `sve`, `neon`: aarch64 with SVE, or Advanced SIMD only (every aarch64 CPU).
- `portable`: the architecture's baseline (x86-64 SSE2, aarch64 without extensions).

`compute_dtype` says what `--dtype auto` computes in on this level: bf16 where the CPU has bf16
dot products, float32 elsewhere (bf16 arithmetic without them costs ~5x float32 in torch)."""

from __future__ import annotations

import ctypes
import os
import platform
from functools import cache
from pathlib import Path

import torch

ENV = "SHARDSERVE_ISA"

# the compiler's target flags for each level
FLAGS: dict[str, tuple[str, ...]] = {
    "amx_bf16": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16",
                 "-mtune=generic"),
    "avx512_bf16": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=generic"),
    "avx512": ("-march=x86-64-v4", "-mtune=generic"),
    "avx2": ("-march=x86-64-v3", "-mtune=generic"),
    "sve": ("-march=armv8.2-a+sve+bf16",),
    "neon": ("-march=armv8-a",),
    "portable": (),
}
X86 = ("amx_bf16", "avx512_bf16", "avx512", "avx2", "portable")
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
_NEEDS["amx_bf16"] = _NEEDS["avx512_bf16"] | {"amx_tile", "amx_bf16"}
# the levels whose bf16 compute has bf16 dot products (`compute_dtype`)
BF16_DOT_LEVELS = ("amx_bf16", "avx512_bf16", "sve")

# Linux's arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): a process uses AMX's tiles only
# after asking for their state (the first tile instruction otherwise kills it with SIGILL)
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


@cache
def amx_permitted() -> bool:
    """Asks Linux for this process's AMX tile state; whether it was granted (the grant is the
    process's, for every thread, and asking again is harmless)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


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
    """Every level this CPU runs, best first (`portable` always last). For this machine's own
    CPU (no `flags` given) `amx_bf16` also needs the kernel's grant of the tile state."""
    this_cpu = flags is None
    flags = cpu_flags() if flags is None else flags
    machine = (machine or platform.machine()).lower()
    order = X86 if machine in ("x86_64", "amd64") else ARM if machine in (
        "aarch64", "arm64") else ("portable",)
    return tuple(level for level in order if level == "portable" or (
        _NEEDS[level] <= flags and not (level == "amx_bf16" and this_cpu
                                        and not amx_permitted())))


# levels the C compiler could not build in this process (`unbuildable`)
_UNBUILDABLE: set[str] = set()


def unbuildable(level: str) -> None:
    """The C compiler failed to build `level` (GCC before 11 knows no AMX flags, before 9 no
    AVX512-BF16): from now on `selected` passes over it to the next level the CPU runs."""
    _UNBUILDABLE.add(level)
    selected.cache_clear()


def forced() -> str:
    """The level `$SHARDSERVE_ISA` names ("" where it is unset; then a level the compiler cannot
    build falls back)."""
    return os.environ.get(ENV, "").strip().lower()


@cache
def selected() -> str:
    """The level this process's kernels use: `$SHARDSERVE_ISA` if set (an error if the CPU
    cannot run it), else the best one the CPU runs that the compiler could build."""
    runnable, level = levels(), forced()
    if not level:
        return next((name for name in runnable if name not in _UNBUILDABLE), "portable")
    if level not in FLAGS:
        raise ValueError(f"{ENV}={level!r}: expected one of {', '.join(FLAGS)}")
    if level not in runnable:
        raise ValueError(f"{ENV}={level!r}: this CPU runs only {', '.join(runnable)}")
    return level


def compute_dtype(level: str | None = None) -> torch.dtype:
    """What a bf16 or fp16 checkpoint computes in on a CPU of this level under `--dtype auto`."""
    return torch.bfloat16 if (level or selected()) in BF16_DOT_LEVELS else torch.float32
