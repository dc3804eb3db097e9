"""Native CPU kernels: built from the C sources beside this file on first use, loaded with ctypes.

torch has no CPU kernel that attends over a paged cache in place: the torch path gathers every
row's blocks into a workspace and then runs two batched matmuls over it, moving each cached byte
three times. `paged_attention.c` reads each key and value once. The others fuse what torch runs
as several small ops, each costing microseconds of dispatch at decode sizes: `rms_norm.c` the
residual add and RMSNorm, `rotary.c` RoPE and the store of the step's keys and values into the
cache, `activation.c` the gated MLP's silu(gate) * up. Each rounds as torch does in the model
dtype (`dtype.h`). `linear.c` replaces torch's matmul over weights packed once after loading:
in bf16 with AVX512-BF16 dot products (`pack_linear`: 1.4x torch at 32 rows, 1.06x at 2048, a
single row's weights streamed at 2.5x torch's rate) or, in the `amx_bf16` build, AMX's tile
products over the same packing (1.5x torch's oneDNN at 32 rows, 0.8x at 512), and in float32
over a bf16 checkpoint's weights kept as bf16 and widened in registers on every other CPU
(`pack_mixed`, `linear_mixed`);
`quant_linear.c` over 4-, 6- and 8-bit block-quantized weights (GGUF's Q4_0, Q4_1, Q8_0, Q4_K, Q6_K;
`replicas/quant.py` packs them): unpacked in registers, 4-bit weights multiplied by the
activations `SHARDSERVE_QUANT_ACTIVATIONS` names (`quant_activations`: float32; bfloat16, with
AVX512-BF16 dot products, the default where the CPU has them; or int8 blocks with integer dot
products, as llama.cpp does) (`linear_q`).
`llama_layers.c` runs all of a Llama-family model's decoder layers of a step in one call over
those kernels (`llama_layers`, bf16 or float32).

The library is compiled with the machine's C compiler (`$CC`, else `cc`) once per ISA level
(`isa.py`: AMX-BF16, AVX512-BF16, AVX-512, AVX2, SVE, NEON, portable), the level chosen at run
time from what the CPU reports or `$SHARDSERVE_ISA`, and cached under
`$SHARDSERVE_CACHE/kernels/<level>-<hash of sources and flags>`; the build is atomic, so
concurrent replicas on one node race harmlessly. Without a compiler (or with
`SHARDSERVE_NATIVE_KERNELS=0`) `load()` returns None and callers keep the torch path.

On GPUs, decode attention over the paged cache is a Triton kernel (`triton_attention.py`)
where Triton is installed (`SHARDSERVE_NATIVE_KERNELS=0` turns it off too);
`supports_paged_decode` says which path a device gets."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import cache
from importlib.util import find_spec
from pathlib import Path

import torch

from replicas.kernels import isa

logger = logging.getLogger(__name__)

_SOURCES = tuple(Path(__file__).with_name(name) for name in
                 ("paged_attention.c", "rms_norm.c", "rotary.c", "activation.c", "linear.c",
                  "quant_linear.c", "llama_layers.c", "sampling.c"))
_HEADERS = tuple(Path(__file__).with_name(name)
                 for name in ("dtype.h", "vec.h", "exp_approx.h", "deal.h", "tiles.h"))
# the target flags come from the ISA level (isa.FLAGS), not -march=native: a build is chosen by
# level at run time, can be forced to a lower one, and a cache shared by nodes of one level fits all
_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-std=gnu11", "-fPIC")
# linked without -ffast-math: with it GCC adds crtfastmath.o, whose constructor turns on
# flush-to-zero and denormals-are-zero for the whole process that loads the library (torch,
# numpy and Python's own floats included), not just for these kernels
_LINK_FLAGS = ("-shared", "-fopenmp")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("SHARDSERVE_CACHE") or Path.home() / ".cache" / "shardserve"
    return Path(root) / "kernels"


def _torch_openmp() -> Path | None:
    lib = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    return lib if lib.exists() else None


def _torch_openmp_link() -> list[str]:
    """Link to the OpenMP runtime torch loads, so that the process has one (two runtimes' thread
    pools would contend for the cores)."""
    gomp = _torch_openmp()
    return [f"-L{gomp.parent}", f"-Wl,-rpath,{gomp.parent}", "-l:libgomp.so.1"] if gomp else []


def build(compiler: str, level: str, link: list[str]) -> Path:
    """The library for ISA `level` compiled by `compiler` and linked with `link` (cached). The
    tests also build the aarch64 levels with a cross compiler and run them under qemu-user."""
    flags = (*_FLAGS, *isa.FLAGS[level])
    sources = [path.read_bytes() for path in _SOURCES + _HEADERS]
    key = hashlib.sha256(b"\0".join([*sources, " ".join(flags + _LINK_FLAGS + tuple(link))
                                     .encode(), platform.machine().encode(), compiler.encode()]))
    out = _cache_dir() / f"{level}-{key.hexdigest()[:16]}" / "libshardserve_kernels.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        staged = Path(tmp) / out.name
        objects = [str(Path(tmp) / f"{source.stem}.o") for source in _SOURCES]
        for source, obj in zip(_SOURCES, objects):
            subprocess.run([compiler, *flags, "-c", str(source), "-o", obj],
                           check=True, capture_output=True, text=True, timeout=120)
        subprocess.run([compiler, *_LINK_FLAGS, *objects, "-o", str(staged), *link, "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(staged, out)
    return out


_PTR, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# each kernel's C arguments; the library exports one function per dtype, NAME_f32 and NAME_bf16
# (and the cache's kernels NAME_f32_bf16kv: float32 activations over a bf16 cache)
_SIGNATURES = {
    "paged_decode_attention": [_PTR] * 6 + [_I64] * 7 + [_F32, _INT],
    "add_rms_norm": [_PTR, _PTR, _PTR, _F32, _PTR, _I64, _I64, _INT],
    "rope_store": [_PTR] * 6 + [_I64] * 5 + [_INT],
    "silu_mul": [_PTR, _PTR, _I64, _I64, _INT],
}
_SUFFIX = {torch.float32: "_f32", torch.bfloat16: "_bf16"}
_CACHE_KERNELS = ("paged_decode_attention", "rope_store")
# (activations, cache) pairs the cache's kernels take
_CACHE_PAIRS = {(torch.float32, torch.float32): "", (torch.bfloat16, torch.bfloat16): "",
                (torch.float32, torch.bfloat16): "_bf16kv"}
_LAYERS = [_PTR, _I64] + [_PTR] * 3 + [_I64] * 6 + [_F32] * 2 + [_PTR] * 5 + [_I64] * 3 + [_INT]
# one-type kernels: the linears over packed weights and the decoder layers built on them
_SINGLE_SIGNATURES = {
    "linear_bf16": [_PTR] * 4 + [_I64] * 3 + [_INT], "linear_bf16_fast": [],
    "linear_mixed": [_PTR] * 4 + [_I64] * 3 + [_INT], "linear_mixed_panel": [],
    "linear_q": [_PTR] * 4 + [_I64] * 3 + [_INT], "linear_q_activations": [],
    "linear_q_set_activations": [_INT],
    "llama_layers_bf16": _LAYERS, "llama_layers_f32": _LAYERS, "llama_layers_q": _LAYERS,
    "llama_layers_f32_bf16kv": _LAYERS, "llama_layers_q_bf16kv": _LAYERS,
    "fma_peak": [_I64, _INT], "bf16_peak": [_I64, _INT],
    "topk_f32": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _INT],
    "argmax_f32": [_PTR, _I64, _I64, _PTR, _INT],
    "logprobs_f32": [_PTR, _I64, _I64, _PTR, _I64] + [_PTR] * 4 + [_INT],
    "penalize_f32": [_PTR, _I64, _I64, _PTR, _I64] + [_PTR] * 5 + [_INT],
    "bitmask_f32": [_PTR, _I64, _PTR, _I64, _PTR, _I64, _INT],
    "draw_f32": [_PTR, _I64, _I64, _I64] + [_PTR] * 6 + [_INT],
    "redraw_f32": [_PTR, _I64, _I64] + [_PTR] * 7 + [_INT],
}


def _declare(lib: ctypes.CDLL) -> None:
    for name, argtypes in _SIGNATURES.items():
        suffixes = ([_SUFFIX[dtype] + mix for (dtype, _), mix in _CACHE_PAIRS.items()]
                    if name in _CACHE_KERNELS else _SUFFIX.values())
        for suffix in suffixes:
            fn = getattr(lib, name + suffix)
            fn.restype = ctypes.c_int
            fn.argtypes = argtypes
    for name, argtypes in _SINGLE_SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_double if name.endswith("_peak") else ctypes.c_int
        fn.argtypes = argtypes


def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None where it cannot be (the torch path is used)."""
    global _lib, _tried
    if _tried:  # the hot path: every norm and attention call asks
        return _lib
    with _lock:
        if not _tried:
            # _tried is set last: a thread passing the unlocked check sees the final _lib
            _lib = _open()
            _tried = True
        return _lib


def _open() -> ctypes.CDLL | None:
    if os.environ.get("SHARDSERVE_NATIVE_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler: the torch paths are used (slower decode attention)")
        return None
    while True:
        level = isa.selected()
        try:
            lib = ctypes.CDLL(str(build(compiler, level, _torch_openmp_link())))
            _declare(lib)
            _set_quant_activations(lib)
        except (OSError, subprocess.SubprocessError, AttributeError) as e:
            detail = getattr(e, "stderr", "") or e
            if (isinstance(e, subprocess.CalledProcessError) and not isa.forced()
                    and level != "portable"):
                # an older compiler than the CPU: the next level down still beats torch's paths
                logger.warning("%s cannot build the %s kernels (%s): trying the next level",
                               compiler, level, str(detail).strip().splitlines()[:1])
                isa.unbuildable(level)
                continue
            logger.warning("native kernels unavailable (%s): using the torch path", detail)
            return None
        logger.info("native CPU kernels built for %s", level)
        return lib


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in _SUFFIX and load() is not None


def supports_cache(dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `rope_store` and `paged_decode_attention` take activations of `dtype` over a
    cache of `kv_dtype` on this CPU: the same type, or float32 over bf16."""
    return (dtype, kv_dtype) in _CACHE_PAIRS and supports(dtype, device)


@cache
def _fast_linear() -> bool:
    lib = load()
    return lib is not None and bool(lib.linear_bf16_fast())


def packs_linear(weight: torch.Tensor) -> bool:
    """Whether `pack_linear` should pack this nn.Linear weight [N, K] for `linear`: bf16 on a CPU
    whose build has AVX512-BF16."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and _fast_linear())


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [ceil(N/32), ceil(K/2), 32, 2], zero-padded: the layout `linear` reads
    (see linear.c)."""
    n, k = weight.shape
    padded = weight.new_zeros(-(-n // 32) * 32, -(-k // 2) * 2)
    padded[:n, :k] = weight
    return padded.view(padded.shape[0] // 32, 32, padded.shape[1] // 2, 2).permute(0, 2, 1, 3) \
        .contiguous()


def packs_mixed(weight: torch.Tensor) -> bool:
    """Whether `pack_mixed` should pack this float32 nn.Linear weight [N, K] for `linear_mixed`:
    on a CPU with the native kernels, when every value is exactly a bf16 (a bf16 checkpoint
    computing in float32), so keeping it as bf16 loses nothing and halves what a step reads.
    Elsewhere torch multiplies (float32 checkpoints: MKL; GPUs: cuBLAS)."""
    if not (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and load() is not None):
        return False
    return bool(torch.equal(weight, weight.to(torch.bfloat16).float()))


@cache
def float32_panel() -> int:
    """Output columns per panel of the float32 linears (`linear_mixed`, `linear_q`) in this
    build: two vectors."""
    lib = load()
    return int(lib.linear_mixed_panel()) if lib is not None else 0


def pack_mixed(weight: torch.Tensor, panel: int | None = None) -> torch.Tensor:
    """float32 weight [N, K] -> bf16 [ceil(N/P), K, P], P this build's panel (or `panel`),
    zero-padded past N, each k's P columns interleaved as (0, P/2), (1, P/2 + 1), ...: the layout
    `linear_mixed` reads (see linear.c's `widen`)."""
    n, k = weight.shape
    panel = panel or float32_panel()
    padded = weight.new_zeros(-(-n // panel) * panel, k, dtype=torch.bfloat16)
    padded[:n] = weight
    panels = padded.view(-1, 2, panel // 2, k).permute(0, 3, 2, 1)  # [panels, K, P/2, 2]
    return panels.reshape(-1, k, panel).contiguous()


@cache
def _has_triton() -> bool:
    return (os.environ.get("SHARDSERVE_NATIVE_KERNELS", "1") != "0"
            and find_spec("triton") is not None)


def supports_paged_decode(dtype: torch.dtype, device: torch.device,
                          kv_dtype: torch.dtype | None = None) -> bool:
    """Whether `paged_decode_attention` runs for queries of `dtype` over caches of `kv_dtype`
    (None: the same) on `device`: the native kernel on CPUs, Triton's on CUDA (float16,
    bfloat16, float32, the cache of the queries' type)."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if device.type == "cuda":
        return (dtype == kv_dtype and dtype in (torch.float16, torch.bfloat16, torch.float32)
                and _has_triton())
    return supports_cache(dtype, kv_dtype, device)


def _kernel(name: str, dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None):
    """The library's `name` for `dtype` (None: a single-dtype kernel) over a cache of
    `kv_dtype` (the cache's kernels); callers check `supports` or `supports_cache` first."""
    lib = load()
    if lib is None:
        raise RuntimeError("native kernels are not available")
    if dtype is None:
        return getattr(lib, name)
    cache = "" if kv_dtype is None else _CACHE_PAIRS[dtype, kv_dtype]
    return getattr(lib, name + _SUFFIX[dtype] + cache)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           block_size: int, scale: float) -> torch.Tensor:
    """q [B, H, D]; caches [Hkv, slots, D]; block_tables [B, nb] int64; context_lens [B] int64.
    Returns [B, H, D]. Call only where `supports_paged_decode(q.dtype, q.device,
    k_cache.dtype)`."""
    if q.device.type == "cuda":
        from replicas.kernels import triton_attention
        return triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                       context_lens, block_size, scale)
    # the C kernel reads the tables and lengths as dense arrays (a row of a view of a wider
    # buffer, as the CUDA graphs' static tables, would be read at the wrong stride)
    q, block_tables, context_lens = (q.contiguous(), block_tables.contiguous(),
                                     context_lens.contiguous())
    out = torch.empty_like(q)
    b, h, d = q.shape
    kv_heads, slots, _ = k_cache.shape
    failed = _kernel("paged_decode_attention", q.dtype, k_cache.dtype)(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), out.data_ptr(), b, h, kv_heads, d, slots // block_size,
        block_size, block_tables.shape[1], scale, torch.get_num_threads())
    if failed:
        raise MemoryError("paged decode attention could not allocate its score buffer")
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """RMSNorm of x (residual None) or of x + residual, which is written into `residual` in
    place; as transformers rounds it. x, residual [..., dim] and weight [dim] of one dtype.
    Call only where `supports(x.dtype, x.device)`."""
    x = x.contiguous()
    if residual is not None and not residual.is_contiguous():
        raise ValueError("the residual is updated in place and must be contiguous")
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _kernel("add_rms_norm", x.dtype)(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), eps,
        out.data_ptr(), x.numel() // dim, dim, torch.get_num_threads())
    return out


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               heads: int, kv_heads: int) -> None:
    """Rotates the q and k heads of qkv [T, heads + 2 * kv_heads, D] in place (cos, sin:
    [T, 1, D/2]) and stores the rotated keys and the values at slot_mapping [T] int64 of the
    caches [kv_heads, slots, D] (rounded to their type). Call only where
    `supports_cache(qkv.dtype, k_cache.dtype, qkv.device)`."""
    if not (qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
        raise ValueError("rope_store wants contiguous qkv, cos, sin and int64 slots")
    tokens, _, dim = qkv.shape
    _kernel("rope_store", qkv.dtype, k_cache.dtype)(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), tokens, heads, kv_heads, dim, k_cache.shape[1],
        torch.get_num_threads())


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x [..., 2 * inter] (gate first), rounded as torch rounds.
    Call only where `supports(x.dtype, x.device)`."""
    x = x.contiguous()
    inter = x.shape[-1] // 2
    out = x.new_empty((*x.shape[:-1], inter))
    _kernel("silu_mul", x.dtype)(x.data_ptr(), out.data_ptr(), x.numel() // (2 * inter), inter,
                                 torch.get_num_threads())
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [out_features, K]^T (+ bias) in bf16 with float32 accumulation, as
    F.linear, over `pack_linear(weight)`. Call only where `packs_linear` held for the weight."""
    if x.dtype != torch.bfloat16 or packed.dtype != x.dtype or (
            bias is not None and bias.dtype != x.dtype):
        raise ValueError("linear takes bfloat16 inputs, weight and bias")
    k = x.shape[-1]
    if packed.dim() != 4 or packed.shape[1] != -(-k // 2) or packed.shape[0] * 32 < out_features:
        raise ValueError(f"linear: a packed weight {tuple(packed.shape)} does not take "
                         f"{k} input features to {out_features}")
    out, failed = _packed_linear("linear_bf16", x, packed, out_features, bias)
    if failed == 2:
        raise MemoryError("linear could not allocate its copy of a ragged block of rows")
    if failed:
        raise RuntimeError("this build has no AVX512-BF16 to multiply packed weights with")
    return out


def linear_mixed(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [out_features, K]^T (+ bias) in float32 over `pack_mixed(weight)`
    (bf16 values widened in registers), as F.linear over the float32 weight up to the order of
    the float32 additions. Call only where `packs_mixed` held for the weight."""
    if x.dtype != torch.float32 or packed.dtype != torch.bfloat16 or (
            bias is not None and bias.dtype != torch.float32):
        raise ValueError("linear_mixed takes float32 inputs and bias over a bf16 packed weight")
    k = x.shape[-1]
    if packed.dim() != 3 or packed.shape[1] != k or packed.shape[0] * packed.shape[2] < out_features:
        raise ValueError(f"linear_mixed: a packed weight {tuple(packed.shape)} does not take "
                         f"{k} input features to {out_features}")
    return _packed_linear("linear_mixed", x, packed, out_features, bias)[0]


def _packed_linear(name: str, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                    bias: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """(x @ the packed weight^T (+ bias) by the kernel `name`, in x's dtype; its return code)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    bias = None if bias is None else bias.contiguous()
    out = x.new_empty((rows.shape[0], out_features))
    failed = _kernel(name)(rows.data_ptr(), packed.data_ptr(),
                           None if bias is None else bias.data_ptr(), out.data_ptr(),
                           rows.shape[0], out_features, k, torch.get_num_threads())
    return out.view(*x.shape[:-1], out_features), failed


# what 4-bit weights (and, but in int8, 8-bit ones) multiply in linear_q, by the C side's
# number (quant_linear.c)
QUANT_ACTIVATIONS = ("float32", "bfloat16", "int8")
QUANT_ACTIVATIONS_ENV = "SHARDSERVE_QUANT_ACTIVATIONS"


def _set_quant_activations(lib: ctypes.CDLL) -> None:
    """`auto` (the default): bfloat16 where the build has AVX512-BF16 dot products (prefill
    projections 1.4-1.7x the float32 tiles, and the default model's greedy answers still
    transformers'),
    else float32. int8 is llama.cpp's arithmetic (2.4-3x float32 at every size, but the default
    model's greedy answers are then llama.cpp's). A choice the build cannot run is float32."""
    asked = os.environ.get(QUANT_ACTIVATIONS_ENV, "auto")
    if asked not in ("auto", *QUANT_ACTIVATIONS):
        raise ValueError(f"{QUANT_ACTIVATIONS_ENV}={asked!r}: one of auto, "
                         f"{', '.join(QUANT_ACTIVATIONS)}")
    mode = lib.linear_q_set_activations(QUANT_ACTIVATIONS.index(
        "bfloat16" if asked == "auto" else asked))
    if asked not in ("auto", QUANT_ACTIVATIONS[mode]):
        logger.warning("%s=%s: not on this CPU's kernels; quantized weights take float32 "
                       "activations", QUANT_ACTIVATIONS_ENV, asked)


def quant_activations() -> str | None:
    """What 4-bit weights (and, but in int8, 8-bit ones) multiply in `linear_q`
    (QUANT_ACTIVATIONS), None without kernels."""
    lib = load()
    return QUANT_ACTIVATIONS[lib.linear_q_activations()] if lib is not None else None


def linear_q(x: torch.Tensor, packed: torch.Tensor, out_features: int,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [out_features, K]^T (+ bias) in float32 over `quant.pack(...)` of a
    block-quantized weight, as F.linear over its dequantized values up to the order of the float32
    additions, with x as `quant_activations()` says for 4-bit weights (bfloat16: x rounded to
    it; int8: `quant.dot_reference` says exactly what is computed). Call only where
    `supports(torch.float32, x.device)` holds."""
    if x.dtype != torch.float32 or packed.dtype != torch.uint8 or (
            bias is not None and bias.dtype != torch.float32):
        raise ValueError("linear_q takes float32 inputs and bias over a packed uint8 weight")
    out, failed = _packed_linear("linear_q", x, packed, out_features, bias)
    if failed:
        raise ValueError(f"linear_q: the packed weight is not a [{out_features}, "
                         f"{x.shape[-1]}] weight packed for this build")
    return out


# the widest window the native top-k takes: its heap is k long, and wider torch's selection is
# as fast (49,152 logits, 2 cores: k = 64 29 against 127 us a row, 256 66 against 147, 1024 512
# against 659, and for 32 flat rows 8.5 against 7.8 ms)
TOPK_MAX = 256


def supports_topk(x: torch.Tensor, k: int) -> bool:
    """Whether `topk` takes x [rows, n] for k: `supports_draw`'s rows, 0 < k <= TOPK_MAX."""
    return supports_draw(x) and 0 < k <= min(TOPK_MAX, x.shape[1])


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k, dim=-1) over x [rows, n]: the values, descending, and their indices;
    equal values the lower index first. NaN is not ordered (torch's puts it first). Call only
    where `supports_topk`."""
    x = x.contiguous()
    values = torch.empty(x.shape[0], k)
    indices = torch.empty(x.shape[0], k, dtype=torch.int64)
    if _kernel("topk_f32")(x.data_ptr(), x.shape[0], x.shape[1], k, values.data_ptr(),
                           indices.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"topk wants 0 < k <= {x.shape[1]}, got {k}")
    return values, indices


def supports_draw(x: torch.Tensor) -> bool:
    """Whether the sampler's row kernels (`draw`, `argmax`, `penalize`, `apply_bitmask`) take
    x [rows, n]: float32 on a CPU with the native kernels."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.shape[1] > 0 and load() is not None)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) over x [rows, n]: the first index of each row's largest value, or of its
    first NaN, as torch's. Call only where `supports_draw`."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _kernel("argmax_f32")(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(),
                          torch.get_num_threads())
    return out


def apply_bitmask(x: torch.Tensor, words: torch.Tensor,
                  rows: torch.Tensor | list[int] | None = None) -> None:
    """structured.bitmask.apply_bitmask in one native pass: the disallowed tokens of x [B, n]'s
    rows (None: all) to -inf in place, by words [B, W] int32 (bit t % 32 of word t // 32: token
    t allowed; tokens past 32 W disallowed). Call only where `supports_draw` and x is
    contiguous."""
    rows = torch.arange(x.shape[0]) if rows is None else torch.as_tensor(rows, dtype=torch.int64)
    words, rows = words.contiguous(), rows.contiguous()
    if words.dim() != 2 or words.shape[0] != x.shape[0] or words.dtype != torch.int32:
        raise ValueError(f"bitmask words {tuple(words.shape)} {words.dtype} do not fit logits "
                         f"{tuple(x.shape)}")
    _kernel("bitmask_f32")(x.data_ptr(), x.shape[1], words.data_ptr(), words.shape[1],
                           rows.data_ptr(), rows.numel(), torch.get_num_threads())


def penalize(x: torch.Tensor, ids: torch.Tensor, lens: torch.Tensor, out_start: torch.Tensor,
             repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> None:
    """The repetition, frequency and presence penalties on x [rows, n] in place (contiguous):
    ids [rows, width] int64 each row's prompt and output tokens (negative: padding), lens and
    out_start [rows] int64, the penalties [rows] float32 (1, 0, 0: none). Call only where
    `supports_draw`."""
    args = [t.contiguous() for t in (ids, lens, out_start)]
    args += [t.float().contiguous() for t in (repetition, frequency, presence)]
    if _kernel("penalize_f32")(x.data_ptr(), x.shape[0], x.shape[1], args[0].data_ptr(),
                               ids.shape[1], *(a.data_ptr() for a in args[1:]),
                               torch.get_num_threads()):
        raise MemoryError("penalize could not allocate its counters")


def supports_logprobs(x: torch.Tensor, k: int) -> bool:
    """Whether `logprobs` takes x [rows, n] with k alternatives: `supports_draw`'s rows,
    0 <= k <= TOPK_MAX."""
    return supports_draw(x) and 0 <= k <= min(TOPK_MAX, x.shape[1])


def logprobs(x: torch.Tensor, tokens: torch.Tensor, k: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From raw logits x [rows, n] and a token a row: each token's log-probability (as
    log_softmax gives it) and rank (1 + the tokens more likely), and each row's k most likely
    tokens' log-probabilities and ids, best first. Call only where `supports_logprobs`."""
    x, tokens = x.contiguous(), tokens.contiguous()
    rows = x.shape[0]
    if tokens.shape != (rows,) or (rows and not 0 <= int(tokens.min()) <= int(tokens.max())
                                   < x.shape[1]):
        raise ValueError(f"logprobs wants a token in [0, {x.shape[1]}) a row")
    chosen, ranks = torch.empty(rows), torch.empty(rows, dtype=torch.int64)
    values, ids = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.int64)
    if _kernel("logprobs_f32")(x.data_ptr(), rows, x.shape[1], tokens.data_ptr(), k,
                               chosen.data_ptr(), ranks.data_ptr(), values.data_ptr(),
                               ids.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"logprobs wants 0 <= k <= {min(TOPK_MAX, x.shape[1])}, got {k}")
    return chosen, ranks, values, ids


def draw(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
         u: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One token a row of x [rows, n] (tempered logits) by inverse transform with uniforms u
    [rows], among the tokens each row's min_p [rows] (float32, 0: none) keeps and inside its
    top_k [rows] (int64, n: none) / top_p [rows] (float32, 1: none) set: within the row's
    window of its largest max(first, top_k + 1) logits where the set closes there, else drawn
    from the whole row (sampling.c). Returns the tokens and a bool per row, False where a row's
    token lies outside its set (rejected: `redraw`). Call only where `supports_draw`."""
    x = x.contiguous()
    rows = x.shape[0]
    tokens = torch.empty(rows, dtype=torch.int64)
    kept = torch.empty(rows, dtype=torch.uint8)
    top_k, top_p, min_p = top_k.contiguous(), top_p.float().contiguous(), min_p.float().contiguous()
    u = u.float().contiguous()
    if _kernel("draw_f32")(x.data_ptr(), rows, x.shape[1], first, top_k.data_ptr(),
                           top_p.data_ptr(), min_p.data_ptr(), u.data_ptr(), tokens.data_ptr(),
                           kept.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"draw wants a row and a window of at least one, got {x.shape[1]}, "
                         f"{first}")
    return tokens, kept.bool()


def redraw(x: torch.Tensor, at: torch.Tensor, tokens: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One rejection round: rows at [R] of x (contiguous, as `draw` had it), whose tokens [R]
    were rejected, each lose that token and every one no more likely, and draw again with u
    [R] inside their top_k / top_p / min_p [R] sets. Returns the new tokens and whether each is
    kept."""
    tokens = tokens.clone()
    kept = torch.empty(at.shape[0], dtype=torch.uint8)
    at, top_k = at.contiguous(), top_k.contiguous()
    top_p, min_p, u = top_p.float().contiguous(), min_p.float().contiguous(), u.float().contiguous()
    if _kernel("redraw_f32")(x.data_ptr(), at.shape[0], x.shape[1], at.data_ptr(),
                             top_k.data_ptr(), top_p.data_ptr(), min_p.data_ptr(), u.data_ptr(),
                             tokens.data_ptr(), kept.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"redraw wants a row of at least one, got {x.shape[1]}")
    return tokens, kept.bool()


def fma_peak_gflops(seconds: float = 1.0, dtype: torch.dtype = torch.float32) -> float:
    """This build's peak on torch's thread count, GFLOP/s, from a register-only loop: float32
    FMAs, or for bf16 AMX tile products in an AMX build, else AVX512-BF16 dot products (0 on a
    build without them). The ceiling the linear kernels are measured against."""
    fn = _kernel("bf16_peak" if dtype == torch.bfloat16 else "fma_peak")
    threads, iterations = torch.get_num_threads(), 1 << 20
    while True:
        started = time.perf_counter()
        flops = fn(iterations, threads)
        elapsed = time.perf_counter() - started
        if elapsed >= seconds or flops == 0.0:
            return flops / elapsed / 1e9
        iterations *= 2


class LlamaLayer(ctypes.Structure):
    """One decoder layer's parameters and cache as `llama_layers` reads them (llama_layers.c):
    data pointers of the norms' weights, the packed projections (qkv_bias None where there is
    none) and the layer's K and V caches."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "down", "k_cache",
        "v_cache")]


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions `llama_layers` computes with (one rank's: it runs only at tp 1)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    scale: float
    quantized: bool = False  # projections packed by quant.pack (float32 activations)
    bf16_cache: bool = False  # float32 activations over a bf16 cache


def llama_layers(layers: ctypes.Array, shape: LlamaShape, x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, cache_slots: int,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer over the step's tokens x [T, hidden] (the embeddings), each token attended as
    a decode row (block_tables [T, nb] and context_lens [T], int64): (the last layer's output,
    the residual stream after it). Bit-identical to the model's Python layers over the same
    kernels. The arrays the pointers in `layers` name must outlive the call."""
    tensors = (cos, sin, slot_mapping, block_tables, context_lens)
    if not all(t.is_contiguous() for t in tensors) or any(
            t.dtype != torch.int64 for t in tensors[2:]):
        raise ValueError("llama_layers wants contiguous cos, sin and int64 slots, tables, lens")
    x = x.contiguous()
    out, residual = torch.empty_like(x), torch.empty_like(x)
    name = "llama_layers_q" if shape.quantized else {
        torch.bfloat16: "llama_layers_bf16", torch.float32: "llama_layers_f32"}[x.dtype]
    # (a bf16 cache under float32 activations only: _layer_table's check)
    name += _CACHE_PAIRS[x.dtype, torch.bfloat16 if shape.bf16_cache else x.dtype]
    failed = _kernel(name)(
        layers, len(layers), x.data_ptr(), out.data_ptr(), residual.data_ptr(), x.shape[0],
        shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.inter, shape.eps,
        shape.scale, cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(),
        block_tables.data_ptr(), context_lens.data_ptr(), block_tables.shape[1], cache_slots,
        block_size, torch.get_num_threads())
    if failed:
        raise MemoryError("the decoder layers could not allocate their buffers")
    return out, residual
