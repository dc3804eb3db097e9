"""Server-side logits processors that requests may name (only those on the server's allowlist,
`--logits-processors`; a request can never make the server import an arbitrary name).

A processor is built per sequence as `factory(**kwargs)` and called each step as
`processor(output_token_ids, logits_row) -> logits_row` (vLLM's per-request signature)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


class NoRepeatNGram:
    """Bans any token that would complete an n-gram already present in the output."""

    def __init__(self, n: int = 3) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError("n must be a positive integer")
        self.n = n

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        n = self.n
        if len(output_ids) < n - 1:
            return logits
        prefix = tuple(output_ids[len(output_ids) - (n - 1):]) if n > 1 else ()
        banned = [output_ids[i + n - 1] for i in range(len(output_ids) - n + 1)
                  if tuple(output_ids[i:i + n - 1]) == prefix]
        if banned:
            logits[banned] = float("-inf")
        return logits


def load_factory(qualname: str) -> Callable[..., LogitsProcessor]:
    """`package.module:Name` or `package.module.Name`."""
    module, _, name = qualname.partition(":") if ":" in qualname else qualname.rpartition(".")
    if not module or not name:
        raise ValueError(f"logits processor {qualname!r} is not a qualified name")
    return getattr(importlib.import_module(module), name)
