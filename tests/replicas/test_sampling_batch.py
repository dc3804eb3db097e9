"""The sampling rows' parameters kept between steps: an unchanged batch reuses its tensors, a
changed one writes only its new rows, and the result equals parameters read row by row."""

from __future__ import annotations

import torch

from replicas.request import SamplingParams, Sequence
from replicas.sampling_batch import BatchParams, SamplingBatch

VOCAB = 100
CPU = torch.device("cpu")


def _seq(seq_id: int, **params: float) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, [1], 1, SamplingParams(max_tokens=4, **params))


def _same(a: BatchParams, b: BatchParams) -> None:
    assert a.greedy == b.greedy and a.top_k == b.top_k and a.top_p == b.top_p
    for name in ("temperature", "min_p", "repetition", "presence", "frequency"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            torch.testing.assert_close(x, y)


def test_kept_params_equal_params_read_row_by_row() -> None:
    batch = SamplingBatch(capacity=2)
    seqs = [_seq(0, temperature=0.0), _seq(1, temperature=0.7, top_p=0.9),
            _seq(2, top_k=5, min_p=0.1), _seq(3, presence_penalty=0.5, repetition_penalty=1.2)]
    first = batch.params(seqs, VOCAB, CPU)
    _same(first, BatchParams.of_seqs(seqs, VOCAB, CPU))
    assert first.greedy == (True, False, False, False) and first.top_k == (100, 100, 5, 100)
    assert first.temperature.tolist() == [1.0, 0.699999988079071, 1.0, 1.0]
    assert batch.params(list(seqs), VOCAB, CPU) is first  # the same rows: the same tensors
    # a row leaves, one joins, the order changes: rows that stay keep their columns
    columns = batch.column_of.copy()
    changed = [seqs[2], _seq(9, temperature=0.3, frequency_penalty=1.0), seqs[0]]
    second = batch.params(changed, VOCAB, CPU)
    _same(second, BatchParams.of_seqs(changed, VOCAB, CPU))
    assert batch.column_of[2] == columns[2] and batch.column_of[0] == columns[0]
    assert set(batch.column_of) == {0, 2, 9}
    plain = batch.params([_seq(20)], VOCAB, CPU)
    assert plain.min_p is None and plain.repetition is None and plain.presence is None
