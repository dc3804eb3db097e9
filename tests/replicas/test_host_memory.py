"""The CPU KV cache's memory: zeroed, shaped, aligned to huge pages, alive as long as the tensor."""

from __future__ import annotations

import gc

import torch

from replicas import host_memory


def test_large_tensors_are_zeroed_aligned_and_outlive_the_call() -> None:
    t = host_memory.zeros((3, 2, 1024, 512), torch.bfloat16)  # 6 MiB
    assert t.shape == (3, 2, 1024, 512) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % (2 << 20) == 0
    assert not t.any()
    gc.collect()  # only the tensor holds the mapping now
    t[2, 1, -1, -1] = 7.0
    t[0].fill_(1.0)
    assert int((t == 1.0).sum()) == 2 * 1024 * 512 and float(t[2, 1, -1, -1]) == 7.0
    assert int((t != 0).sum()) == 2 * 1024 * 512 + 1


def test_small_tensors_are_plain_zeros() -> None:
    t = host_memory.zeros((4, 8), torch.float32)
    assert t.shape == (4, 8) and not t.any()
