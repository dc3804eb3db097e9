"""apply_bitmask masks exactly the disallowed ids, on the chosen rows only."""

from __future__ import annotations

import torch

from structured.bitmask import allocate, apply_bitmask


def pack(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    mask = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int64)
    for row, ids in enumerate(allowed):
        for i in ids:
            mask[row, i // 32] |= 1 << (i % 32)
    return torch.where(mask >= 2**31, mask - 2**32, mask).to(torch.int32)


def test_allocate_allows_everything():
    mask = allocate(3, 70)
    assert mask.shape == (3, 3) and mask.dtype == torch.int32 and bool((mask == -1).all())


def test_apply_masks_exactly_the_disallowed_ids():
    vocab = 70
    allowed = [{0, 31, 32, 63, 69}, set(range(0, 70, 3)), {5}]
    logits = torch.randn(3, vocab)
    expected = logits.clone()
    for row, ids in enumerate(allowed):
        for i in range(vocab):
            if i not in ids:
                expected[row, i] = float("-inf")
    apply_bitmask(logits, pack(allowed, vocab))
    assert torch.equal(logits, expected)


def test_only_the_given_rows():
    vocab = 40
    logits = torch.randn(4, vocab)
    before = logits.clone()
    mask = allocate(4, vocab)
    mask[1] = pack([{3}], vocab)[0]
    mask[3] = pack([{7, 39}], vocab)[0]
    mask[2] = 0  # not applied: row 2 is unconstrained this step
    apply_bitmask(logits, mask, rows=[1, 3])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    assert [i for i in range(vocab) if logits[1, i] > float("-inf")] == [3]
    assert [i for i in range(vocab) if logits[3, i] > float("-inf")] == [7, 39]
    apply_bitmask(logits, mask, rows=torch.tensor([], dtype=torch.long))  # nothing to do


def test_logits_wider_than_the_mask_are_disallowed():
    logits = torch.zeros(1, 40)
    apply_bitmask(logits, allocate(1, 32))
    assert bool((logits[0, :32] == 0).all()) and bool((logits[0, 32:] == float("-inf")).all())


def test_shape_mismatch_raises():
    import pytest

    with pytest.raises(ValueError):
        apply_bitmask(torch.zeros(2, 40), allocate(3, 40))
