"""Host int64 tensors built through array('q') equal torch.tensor's."""

from __future__ import annotations

import torch

from replicas import host_tensors


def test_int64_matches_torch_tensor() -> None:
    values = [3, -1, 2**40, 0]
    out = host_tensors.int64(values)
    assert out.dtype == torch.int64 and torch.equal(out, torch.tensor(values))
    assert torch.equal(host_tensors.int64(iter(range(5))), torch.arange(5))
    empty = host_tensors.int64([])
    assert empty.dtype == torch.int64 and empty.shape == (0,)


def test_int64_tensors_do_not_share_their_source() -> None:
    values = [1, 2, 3]
    out = host_tensors.int64(values)
    values[0] = 9
    assert out.tolist() == [1, 2, 3]

