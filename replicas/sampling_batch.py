"""The sampling rows' scalar parameters as tensors, kept between steps (vLLM's persistent batch).

A sequence's temperature, top-k, top-p, min-p and penalties are written once, into a column of one
array, on the first step it samples in (and again only if it left the batch meanwhile); a step
whose sampling rows changed gathers its columns in one indexing, and a step with the same rows as
the last reuses the last step's tensors outright, so an unchanged batch costs no work at all. The
sampler takes the result (`BatchParams`) instead of reading every row's `SamplingParams` again."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from replicas.request import SamplingParams, Sequence

# the rows of `SamplingBatch.values`, one column per sequence
FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition", "presence", "frequency")


def _column(p: SamplingParams) -> tuple[float, ...]:
    return (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
            p.frequency_penalty)


@dataclass(frozen=True)
class BatchParams:
    """One step's sampling rows' parameters, in row order."""

    greedy: tuple[bool, ...]
    temperature: torch.Tensor  # [B] float32; 1 where a row is greedy
    top_k: tuple[int, ...]  # the vocabulary's size where a row has no top-k
    top_p: tuple[float, ...]
    # [B] float32, or None where no row of the batch uses it
    min_p: torch.Tensor | None
    repetition: torch.Tensor | None
    presence: torch.Tensor | None
    frequency: torch.Tensor | None

    @property
    def all_greedy(self) -> bool:
        return all(self.greedy)

    @classmethod
    def of(cls, columns: np.ndarray, vocab: int, device: torch.device) -> BatchParams:
        """From `columns`: [len(FIELDS), B] float64, one column a row."""
        temperature, top_k, top_p, min_p, repetition, presence, frequency = columns
        greedy = temperature == 0.0

        def used(values: np.ndarray, off: float) -> torch.Tensor | None:
            if (values == off).all():
                return None
            return torch.from_numpy(values.astype(np.float32)).to(device)
        return cls(tuple(greedy.tolist()),
                   torch.from_numpy(np.where(greedy, 1.0, temperature).astype(np.float32)
                                    ).to(device),
                   tuple(int(k) if 0 < k < vocab else vocab for k in top_k.tolist()),
                   tuple(top_p.tolist()), used(min_p, 0.0), used(repetition, 1.0),
                   used(presence, 0.0), used(frequency, 0.0))

    @classmethod
    def of_seqs(cls, seqs: Seq[Sequence], vocab: int, device: torch.device) -> BatchParams:
        columns = np.array([_column(s.params) for s in seqs], dtype=np.float64).reshape(
            len(seqs), len(FIELDS)).T
        return cls.of(columns, vocab, device)


class SamplingBatch:
    def __init__(self, capacity: int = 64) -> None:
        self.values = np.zeros((len(FIELDS), capacity), dtype=np.float64)
        self.column_of: dict[int, int] = {}  # seq_id -> its column
        self._free = list(range(capacity - 1, -1, -1))
        self._last: tuple[tuple[int, ...], int, torch.device, BatchParams] | None = None

    def params(self, seqs: Seq[Sequence], vocab: int, device: torch.device) -> BatchParams:
        ids = tuple(s.seq_id for s in seqs)
        last = self._last
        if last is not None and last[0] == ids and last[1] == vocab and last[2] == device:
            return last[3]
        current = set(ids)
        for seq_id in [k for k in self.column_of if k not in current]:
            self._free.append(self.column_of.pop(seq_id))
        for s in seqs:
            if s.seq_id not in self.column_of:
                column = self._claim()
                self.values[:, column] = _column(s.params)
                self.column_of[s.seq_id] = column
        index = np.fromiter((self.column_of[i] for i in ids), np.int64, len(ids))
        params = BatchParams.of(self.values[:, index], vocab, device)
        self._last = (ids, vocab, device, params)
        return params

    def _claim(self) -> int:
        if not self._free:
            old = self.values.shape[1]
            self.values = np.concatenate([self.values, np.zeros_like(self.values)], axis=1)
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()
