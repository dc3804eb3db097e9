"""Packed token bitmasks: allocate them, and apply them to a batch of logits in one set of tensor ops.

Layout (shared with outlines-core and llguidance): int32 `[batch, ceil(vocab_size / 32)]`; bit
`t % 32` of word `t // 32` set means token t is allowed.
"""

from __future__ import annotations

from typing import Sequence

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allocate(batch: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """A CPU bitmask with every token allowed. Pin it when logits live on a GPU."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32,
                      pin_memory=pin_memory)


def _shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return shifts


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: torch.Tensor | Sequence[int] | None = None) -> None:
    """Set the logits of disallowed tokens to -inf, in place.

    logits: [B, V] float on any device; bitmask: [B, W] int32 (CPU or the logits' device) whose row
    i is the mask of logits row i; rows: the constrained rows (None: all). Token ids at or past
    32 * W are disallowed.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} "
                         "must both be [batch, ...] with the same batch")
    if rows is not None:
        rows = torch.as_tensor(rows, dtype=torch.long, device=bitmask.device)
        if rows.numel() == 0:
            return
        masks = bitmask.index_select(0, rows).to(logits.device, non_blocking=True)
        rows = rows.to(logits.device, non_blocking=True)
    else:
        masks = bitmask.to(logits.device, non_blocking=True)
    vocab = logits.shape[1]
    covered = min(vocab, masks.shape[1] * 32)
    bits = (masks.unsqueeze(-1) >> _shifts(logits.device)) & 1  # [R, W, 32]
    disallowed = bits.view(masks.shape[0], -1)[:, :covered] == 0
    if vocab > covered:
        disallowed = torch.nn.functional.pad(disallowed, (0, vocab - covered), value=True)
    if rows is None:
        logits.masked_fill_(disallowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(disallowed, float("-inf"))
