"""The runner's persistent block tables, and the step tensors `ModelRunner.prepare` builds from
them against the same tensors built row by row from plain lists."""

from __future__ import annotations

import random

import pytest
import torch

from replicas.block_tables import BlockTables
from replicas.model_runner import ModelRunner, RowInput, StepInput

BLOCK = 16


def test_tables_grow_by_deltas_and_rows_are_reused_clean() -> None:
    tables = BlockTables(pad=7, rows=2, width=2)
    rows = tables.apply((), [(1, (3, 4)), (2, (5,)), (3, (6,))])  # a third row: the array grows
    assert len(set(rows.tolist())) == 3 and tables.array.shape[0] >= 3
    tables.apply((), [(1, (8, 9, 10)), (2, ())])  # past the width: the columns grow
    assert tables.table(1) == [3, 4, 8, 9, 10] and tables.table(2) == [5]
    assert tables.array[rows[1], 1:].tolist() == [7] * (tables.array.shape[1] - 1)
    freed_row = int(rows[0])
    again = tables.apply((1,), [(4, (11,))])  # seq 1's row goes to seq 4, emptied first
    assert int(again[0]) == freed_row and tables.table(4) == [11]
    assert tables.array[freed_row, 1:].tolist() == [7] * (tables.array.shape[1] - 1)
    assert set(tables.row_of) == {2, 3, 4}


def test_anonymous_rows_last_one_step() -> None:
    tables = BlockTables()
    first = tables.apply((), [(None, (1, 2)), (5, (3,))])
    assert tables.array[first[0], :2].tolist() == [1, 2] and set(tables.row_of) == {5}
    second = tables.apply((), [(None, (9,))])
    assert int(second[0]) == int(first[0])  # freed at the next step, then taken again
    assert tables.array[second[0], :2].tolist() == [9, 0]


def _reference(rows: list[RowInput], tables: list[list[int]], native_prefill: bool,
               varlen: bool) -> dict[str, list]:
    """The step's tensors as plain lists, row by row (the runner's construction before the
    tables were kept in an array)."""
    def slots(table: list[int], start: int, end: int) -> list[int]:
        return [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
    out: dict[str, list] = {k: [] for k in (
        "ids", "positions", "slots", "decode_index", "decode_tables", "decode_lens", "prefill",
        "prefill_index", "kv_slots")}
    width = max((-(-(r.start + len(r.token_ids)) // BLOCK) for r in rows
                 if len(r.token_ids) == 1 or native_prefill), default=0)
    for row, table in zip(rows, tables):
        n, offset = len(row.token_ids), len(out["ids"])
        out["ids"] += row.token_ids
        out["positions"] += range(row.start, row.start + n)
        out["slots"] += slots(table, row.start, row.start + n)
        if n == 1 or native_prefill:
            out["decode_index"] += range(offset, offset + n)
            out["decode_tables"] += [(table + [0] * width)[:width]] * n
            out["decode_lens"] += range(row.start + 1, row.start + n + 1)
        elif varlen:
            out["prefill_index"] += range(offset, offset + n)
            out["kv_slots"] += slots(table, 0, row.start) + slots(table, row.start, row.start + n)
            out["prefill"].append((offset, offset + n, None))
        else:
            out["prefill"].append((offset, offset + n, None if row.start == 0
                                   else slots(table, 0, row.start + n)))
    return out


@pytest.mark.parametrize(("native_prefill", "varlen"), [(True, False), (False, False),
                                                        (False, True)])
def test_prepare_matches_row_by_row_lists(native_prefill: bool, varlen: bool) -> None:
    rng = random.Random(5)
    kv = torch.zeros(1, 2, 2, 400 * BLOCK, 8)
    runner = ModelRunner(None, kv, BLOCK)  # type: ignore[arg-type]
    runner.native_prefill, runner.varlen_prefill = native_prefill, varlen
    free = list(range(400))
    rng.shuffle(free)
    tables: dict[int, list[int]] = {}
    lengths: dict[int, int] = {}
    for step_no in range(6):
        rows, whole = [], []
        for seq_id in range(12):
            if seq_id % 4 == step_no % 4 and seq_id in tables:  # finished: freed
                continue
            start = lengths.get(seq_id, 0)
            # fresh prompts, chunks after a prefix (not block-aligned), decode rows
            n = rng.choice((1, 1, 1, 5, 37)) if start else rng.choice((1, 20, 40))
            table = tables.setdefault(seq_id, [])
            gained = [free.pop() for _ in range(-(-(start + n) // BLOCK) - len(table)
                                                + rng.choice((0, 0, 1)))]  # some reserve ahead
            table += gained
            rows.append(RowInput(tuple(rng.randrange(100) for _ in range(n)), start,
                                 tuple(gained), True, seq_id=seq_id))
            whole.append(list(table))
            lengths[seq_id] = start + n
        freed = tuple(s for s in tables if s % 4 == step_no % 4 and s not in
                      {r.seq_id for r in rows})
        step = StepInput(tuple(rows), freed)
        ids, pos, meta = runner.prepare(step, runner.update_tables(step))
        for seq_id in freed:
            free += tables.pop(seq_id)
            del lengths[seq_id]
        want = _reference(rows, whole, native_prefill, varlen)
        assert ids.tolist() == want["ids"] and pos.tolist() == want["positions"]
        assert meta.slot_mapping.tolist() == want["slots"]
        if want["decode_index"]:
            assert meta.decode_token_index.tolist() == want["decode_index"]
            assert meta.decode_block_tables.tolist() == want["decode_tables"]
            assert meta.decode_context_lens.tolist() == want["decode_lens"]
        else:
            assert meta.decode_token_index is None
        got_prefill = [(r.start, r.end, None if r.context_slots is None
                        else r.context_slots.tolist()) for r in meta.prefill_rows]
        assert got_prefill == want["prefill"]
        if want["prefill_index"]:
            assert meta.prefill_varlen.token_index.tolist() == want["prefill_index"]
            assert meta.prefill_varlen.kv_slots.tolist() == want["kv_slots"]
        else:
            assert meta.prefill_varlen is None
        assert set(runner.block_tables.row_of) == {r.seq_id for r in rows} - set(freed)
