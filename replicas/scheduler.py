"""Continuous batching under a token budget, one rule for prefill and decode.

Each step catches every running sequence's computed tokens up towards its length (one token for a
decoding sequence, a chunk of the prompt for a prefilling one) within `max_num_batched_tokens`, then
admits waiting sequences while budget, sequence slots and KV blocks last. When blocks run out, the
running sequence that would be served last is preempted: its blocks are freed and it waits to be
recomputed (its prefix is usually still cached).

With `max_waiting_steps` > 0, sequences that arrive while every running one decodes wait up to
that many steps and then join together (TGI's `max_waiting_tokens`): under a steady stream of
arrivals nearly every step would otherwise carry a prompt chunk or two, and on a GPU fewer,
fuller steps served more (benchmarks/RESULTS.md, 2026-11-28)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from replicas.kv_cache import BlockManager
from replicas.request import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    priority_scheduling: bool = False
    max_waiting_steps: int = 0  # decode-only steps new sequences may sit out (0: none)


class ScheduledSeq(NamedTuple):
    """A sequence's share of a step (a NamedTuple, not a frozen dataclass: one per row per
    step; `of` builds it)."""

    seq: Sequence
    num_new_tokens: int
    # True when this step computes the sequence's last known token, so a new one is sampled;
    # fixed when scheduled (with async scheduling the engine advances the sequence before the
    # step's result comes back)
    samples: bool
    # the sequence's computed tokens and table epoch when scheduled
    before: int
    epoch: int

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
        before = seq.num_computed_tokens
        return cls(seq, num_new_tokens, before + num_new_tokens == len(seq), before,
                   seq.table_epoch)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._held = 0  # consecutive steps the waiting sequences sat out
        self.num_held_steps = 0  # all such steps

    def _order(self, seq: Sequence) -> tuple:
        if self.config.priority_scheduling:
            return (seq.priority, seq.arrival, seq.seq_id)
        return (seq.arrival, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if self.config.priority_scheduling:
            self.waiting = deque(sorted(self.waiting, key=self._order))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drops a finished or aborted sequence and frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_sequence(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.blocks.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _hold(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether the waiting sequences sit this step out: only a decode-only step (one that
        would stay a CUDA graph) is kept so, for at most `max_waiting_steps` steps in a row."""
        if (self._held >= self.config.max_waiting_steps or not scheduled
                or any(s.num_new_tokens != 1 for s in scheduled)):
            return False
        self._held += 1
        self.num_held_steps += 1
        return True

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        self.running.sort(key=self._order)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            while not self.blocks.allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq.of(seq, num_new))
                budget -= num_new
                i += 1
                continue
            break  # seq itself was preempted: nothing later in the order can fit either
        if (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
                and self._hold(scheduled)):
            return scheduled
        self._held = 0
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            self.blocks.match_prefix(seq)
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            if not self.blocks.allocate(seq, num_new):
                self.blocks.free_sequence(seq)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq.of(seq, num_new))
            budget -= num_new
        return scheduled
