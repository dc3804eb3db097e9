"""Host memory on CPUs: the KV cache backed by transparent huge pages where the kernel allows, and
the heap's free pages handed back after loading.

A decode step reads each row's cached keys and values from blocks scattered over the whole
cache, a 2 KB block here and the next megabytes away: with 4 KB pages nearly every block costs a
TLB miss and a page walk. On the project's 2-core EPYC (THP in `madvise` mode, as most
distributions ship it) 30 layers of decode attention over 32 rows of 200 tokens in shuffled
blocks took 23.3 and 25.6 ms on 4 KB pages and 17.9 and 24.2 ms on 2 MB pages (medians of 8
interleaved runs, twice). torch only asks for huge pages when
THP_MEM_ALLOC_ENABLE is set before it starts, which a Ray worker cannot rely on; this module asks
for them itself."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap

import torch

_HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in its own anonymous mapping, advised for huge pages (a plain
    torch.zeros where the platform has no MADV_HUGEPAGE). The tensor keeps the mapping alive."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    nbytes = math.prod(shape) * dtype.itemsize
    if advice is None or nbytes < _HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    # one huge page more than needed, so the tensor can start on a 2 MB boundary
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # THP disabled ("never") or an old kernel: ordinary pages, still zeroed
        pass
    start = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % _HUGE_PAGE
    tensor = torch.frombuffer(region, dtype=dtype, count=math.prod(shape), offset=offset)
    # the kernel would hand out (zeroed) pages as blocks are first used; touching them all now
    # takes the cache's whole budget at start, as torch.zeros did, so a short machine fails at
    # startup and the resident size does not creep up under load
    return tensor.zero_().view(shape)


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
