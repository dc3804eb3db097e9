"""Logits processors for tests: ones that fail on purpose (a server's allowlist names them)."""

from __future__ import annotations

import time

import torch


class FailsAfter:
    """Raises (or returns a row of the wrong shape) once the output has `after` tokens."""

    def __init__(self, after: int = 0, wrong_shape: bool = False) -> None:
        self.after = after
        self.wrong_shape = wrong_shape

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_ids) < self.after:
            return logits
        if self.wrong_shape:
            return logits[:10]
        raise RuntimeError("this processor fails on purpose")


class Hangs:
    """Blocks the engine's compute thread once the output has `after` tokens: a hung forward,
    for the core's step watchdog."""

    def __init__(self, after: int = 0) -> None:
        self.after = after

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_ids) >= self.after:
            time.sleep(3600)
        return logits
