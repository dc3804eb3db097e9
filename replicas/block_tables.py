"""A runner's block tables, kept between steps in one int64 array (vLLM's persistent batch).

Each sequence the runner has seen owns a row of `array` until a step frees it; a step's
`RowInput.blocks` (the blocks the table gained) are written at the end of that row, so a step
costs one row write per row that gained a block, and the step's tensors are slices and gathers of
the array (`ModelRunner.prepare`) instead of lists rebuilt and copied every step. Rows and
columns grow on demand (doubling); cells past a table's end hold `pad`, a block that is safe to
read (the CUDA graphs' padding block, else 0)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTables:
    def __init__(self, pad: int = 0, rows: int = 64, width: int = 64) -> None:
        self.pad = pad
        self.array = np.full((rows, width), pad, dtype=np.int64)
        self.lengths = np.zeros(rows, dtype=np.int64)
        self.row_of: dict[int, int] = {}  # seq_id -> its row
        self._free = list(range(rows - 1, -1, -1))
        self._scratch: list[int] = []  # rows of anonymous step rows, freed at the next step

    def __len__(self) -> int:
        return len(self.row_of)

    def table(self, seq_id: int) -> list[int]:
        row = self.row_of[seq_id]
        return self.array[row, :self.lengths[row]].tolist()

    def apply(self, freed: Sequence[int], rows: Sequence[tuple[int | None, Sequence[int]]]
              ) -> np.ndarray:
        """Drops the `freed` sequences' tables, then appends each (seq_id, blocks) row's new
        blocks to its table (a seq_id of None: a table used for this step only, `blocks` whole);
        the array row of each, in order."""
        for row in self._scratch:
            self._free.append(row)
        self._scratch.clear()
        for seq_id in freed:
            row = self.row_of.pop(seq_id, None)
            if row is not None:
                self._free.append(row)
        out = np.empty(len(rows), dtype=np.int64)
        for i, (seq_id, blocks) in enumerate(rows):
            row = self.row_of.get(seq_id) if seq_id is not None else None
            if row is None:
                row = self._claim()
                if seq_id is None:
                    self._scratch.append(row)
                else:
                    self.row_of[seq_id] = row
            if blocks:
                self._extend(row, blocks)
            out[i] = row
        return out

    def _claim(self) -> int:
        if not self._free:
            old = len(self.lengths)
            self.array = np.concatenate([self.array, np.full_like(self.array, self.pad)])
            self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        row = self._free.pop()
        if self.lengths[row]:
            self.array[row, :self.lengths[row]] = self.pad
            self.lengths[row] = 0
        return row

    def _extend(self, row: int, blocks: Sequence[int]) -> None:
        start = int(self.lengths[row])
        end = start + len(blocks)
        if end > self.array.shape[1]:
            width = max(end, 2 * self.array.shape[1])
            grown = np.full((self.array.shape[0], width), self.pad, dtype=np.int64)
            grown[:, :self.array.shape[1]] = self.array
            self.array = grown
        self.array[row, start:end] = blocks
        self.lengths[row] = end
