"""Packed token bitmasks: allocate them, and apply them to a batch of logits in one set of tensor ops.

Layout (shared with outlines-core and llguidance): int32 `[batch, ceil(vocab_size / 32)]`; bit
`t % 32` of word `t // 32` set means token t is allowed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

# Bits are unpacked a byte at a time (the int32 words viewed as bytes, least significant first on a
# little-endian host): 8 masks per byte is cheaper than 32 shifts per word.
_LITTLE_ENDIAN = sys.byteorder == "little"
_BYTE_BITS: dict[torch.device, torch.Tensor] = {}
_WORD_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allocate(batch: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """A CPU bitmask with every token allowed. Pin it when logits live on a GPU."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32,
                      pin_memory=pin_memory)


def _disallowed(masks: torch.Tensor) -> torch.Tensor:
    """[R, W] int32 words -> [R, 32 * W] bool, True where the token's bit is clear."""
    device = masks.device
    if _LITTLE_ENDIAN:
        bits = _BYTE_BITS.get(device)
        if bits is None:
            bits = _BYTE_BITS[device] = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8,
                                                     device=device)
        unpacked = torch.bitwise_and(masks.contiguous().view(torch.uint8).unsqueeze(-1), bits)
    else:
        shifts = _WORD_SHIFTS.get(device)
        if shifts is None:
            shifts = _WORD_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
        unpacked = (masks.unsqueeze(-1) >> shifts) & 1
    return (unpacked == 0).view(masks.shape[0], -1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: torch.Tensor | Sequence[int] | None = None) -> None:
    """Set the logits of disallowed tokens to -inf, in place.

    logits: [B, V] float on any device; bitmask: [B, W] int32 (CPU, pinned for a GPU, or on the
    logits' device) whose row i is the mask of logits row i; rows: the constrained rows (None: all).
    Token ids at or past 32 * W are disallowed.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} "
                         "must both be [batch, ...] with the same batch")
    vocab = logits.shape[1]
    covered = min(vocab, bitmask.shape[1] * 32)
    if rows is None:
        disallowed = _disallowed(bitmask.to(logits.device, non_blocking=True))
        logits[:, :covered].masked_fill_(disallowed[:, :covered], float("-inf"))
        logits[:, covered:] = float("-inf")
        return
    rows = torch.as_tensor(rows, dtype=torch.long, device=bitmask.device)
    if rows.numel() == 0:
        return
    disallowed = _disallowed(bitmask.index_select(0, rows).to(logits.device, non_blocking=True))
    rows = rows.to(logits.device, non_blocking=True)
    selected = logits.index_select(0, rows)
    selected[:, :covered].masked_fill_(disallowed[:, :covered], float("-inf"))
    selected[:, covered:] = float("-inf")
    logits.index_copy_(0, rows, selected)
