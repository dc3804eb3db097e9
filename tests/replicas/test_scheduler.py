"""The scheduler's admission of waiting sequences beside running ones (no model, no Ray)."""

from __future__ import annotations

from replicas.kv_cache import BlockManager
from replicas.request import SamplingParams, Sequence
from replicas.scheduler import ScheduledSeq, Scheduler, SchedulerConfig

PARAMS = SamplingParams(max_tokens=64)


def _seq(i: int, prompt: int = 8) -> Sequence:
    return Sequence(i, f"r{i}", 0, list(range(10, 10 + prompt)), prompt, PARAMS, arrival=float(i))


def _step(scheduler: Scheduler) -> list[ScheduledSeq]:
    """One step as the engine takes it: the scheduled tokens computed, one sampled where due."""
    scheduled = scheduler.schedule()
    for s in scheduled:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_new_tokens
        if samples:
            s.seq.token_ids.append(7)
    return scheduled


def _scheduler(waiting_steps: int, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                     max_waiting_steps=waiting_steps),
                     BlockManager(64, 4, enable_prefix_caching=False))


def test_arrivals_beside_decoding_rows_wait_their_steps_then_join_together() -> None:
    scheduler = _scheduler(waiting_steps=3)
    scheduler.add(_seq(0))
    assert [s.num_new_tokens for s in _step(scheduler)] == [8]  # nothing runs: at once
    scheduler.add(_seq(1))
    held = [_step(scheduler) for _ in range(2)]
    scheduler.add(_seq(2))
    # decode-only steps (a CUDA graph's): the arrivals sit out 3 of them in a row ...
    held.append(_step(scheduler))
    assert [[s.num_new_tokens for s in step] for step in held] == [[1], [1], [1]]
    # ... then both join in one step
    joined = _step(scheduler)
    assert [(s.seq.seq_id, s.num_new_tokens) for s in joined] == [(0, 1), (1, 8), (2, 8)]


def test_a_step_that_prefills_anyway_takes_arrivals_at_once() -> None:
    # a 40-token prompt over a 24-token budget: its second chunk makes the step eager already
    scheduler = _scheduler(waiting_steps=3, budget=24)
    scheduler.add(_seq(0, prompt=40))
    assert [s.num_new_tokens for s in _step(scheduler)] == [24]
    scheduler.add(_seq(1))
    step = _step(scheduler)
    assert [(s.seq.seq_id, s.num_new_tokens) for s in step] == [(0, 16), (1, 8)]


def test_without_waiting_steps_an_arrival_joins_the_next_step() -> None:
    scheduler = _scheduler(waiting_steps=0)
    scheduler.add(_seq(0))
    _step(scheduler)
    scheduler.add(_seq(1))
    assert [(s.seq.seq_id, s.num_new_tokens) for s in _step(scheduler)] == [(0, 1), (1, 8)]
