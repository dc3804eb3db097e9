"""Host memory on CPUs: the weights and the KV cache backed by transparent huge pages where the
kernel allows, and the heap's free pages handed back after loading.

A decode step streams every weight once, and reads each row's cached keys and values from blocks
scattered over the whole cache, a 2 KB block here and the next megabytes away: on 4 KB pages
every 4 KB of a weight, and nearly every cache block, costs a TLB miss and a page walk. On the
project's 2-core EPYC (THP in `madvise` mode, as most distributions ship it), bench-135m's
one-row decode step ran 1.06-1.19x faster (five runs; 6.60 against 5.54 ms in one) with its
weights in one huge-page mapping than where torch's allocator put them (4 KB pages), and a sum
over 512 MB read 52-62 against 42-47 GB/s; 30 layers of decode attention over 32 rows of 200
tokens in shuffled blocks took 23.3 and 25.6 ms on 4 KB pages and 17.9 and 24.2 ms on 2 MB pages
(medians of 8 interleaved runs, twice). torch only asks for huge pages when THP_MEM_ALLOC_ENABLE
is set before it starts, which a Ray worker cannot rely on; this module asks for them itself."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap

import torch

_HUGE_PAGE = 2 << 20


def _huge_region(nbytes: int) -> torch.Tensor | None:
    """`nbytes` uint8 in an anonymous mapping of their own advised for huge pages, starting on a
    2 MB boundary, not yet touched (the kernel hands out zeroed pages as they are first written);
    None where the platform has no MADV_HUGEPAGE or `nbytes` is under one huge page. The tensor
    keeps the mapping alive."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < _HUGE_PAGE:
        return None
    # one huge page more than needed, so the tensor can start on a 2 MB boundary
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # THP disabled ("never") or an old kernel: ordinary pages
        pass
    start = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=-start % _HUGE_PAGE)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in its own anonymous mapping, advised for huge pages (a plain
    torch.zeros where the platform has no MADV_HUGEPAGE). The tensor keeps the mapping alive."""
    region = _huge_region(math.prod(shape) * dtype.itemsize)
    if region is None:
        return torch.zeros(shape, dtype=dtype)
    # the kernel would hand out (zeroed) pages as blocks are first used; touching them all now
    # takes the cache's whole budget at start, as torch.zeros did, so a short machine fails at
    # startup and the resident size does not creep up under load
    return region.view(dtype).zero_().view(shape)


_ALIGN = 64  # each weight starts on a cache line, as torch's allocator starts it


def weights_to_huge_pages(model: torch.nn.Module) -> int:
    """Moves the model's CPU parameters into one mapping advised for huge pages, in the order the
    model registers them (the order a step reads them, layer by layer), each on a cache line;
    returns the bytes moved (0 where the platform has no huge pages). Call it once the weights
    are loaded and packed and before anything keeps their addresses (the native layers' table is
    built on the first forward). Tied parameters stay one tensor. Each old tensor is freed as
    its copy lands, so loading peaks at the weights plus one of them, not twice the weights."""
    params = [p for p in model.parameters() if p.device.type == "cpu"]
    # tied weights share a Parameter (model.parameters() yields it once) or, loaded apart, its
    # storage: one copy for each (address, shape, strides, dtype)
    moved: dict[tuple, torch.Tensor] = {}
    layout: list[tuple[torch.nn.Parameter, tuple, int]] = []
    total = 0
    for p in params:
        key = (p.data_ptr(), tuple(p.shape), p.stride(), p.dtype)
        if key in moved:
            layout.append((p, key, -1))
            continue
        moved[key] = p
        layout.append((p, key, total))
        total += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    region = _huge_region(total)
    if region is None:
        return 0
    for p, key, offset in layout:
        if offset < 0:
            p.data = moved[key]
            continue
        nbytes = p.numel() * p.element_size()
        copy = region[offset:offset + nbytes].view(p.dtype).view(p.shape)
        copy.copy_(p.data)
        moved[key] = copy
        p.data = copy  # the old storage goes with its last reference
    return total


def tensors_to_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` laid out as `weights_to_huge_pages` lays out a model's (the benchmarks' packed
    weights, so they read what the served ones read): the moved tensors in order, or the same
    ones where nothing moved."""
    holder = torch.nn.ParameterList(torch.nn.Parameter(t, requires_grad=False) for t in tensors)
    weights_to_huge_pages(holder)
    return [p.data for p in holder]


def release_free_heap() -> None:
    """Returns the C heap's free pages to the system (glibc's malloc_trim; nothing elsewhere).
    Loading frees hundreds of MB of temporaries (float embeddings replaced by quantized rows,
    packing's copies) below glibc's mmap threshold, which torch's own frees of untouched
    parameters raise: without this they stay resident (~80 MB for SmolLM2-135M's GGUF)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        trim = None
    if trim is not None:
        trim(0)
