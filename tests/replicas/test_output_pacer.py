"""The engine core's output pacing (replicas/output_pacer.py), without a model: which steps'
outputs leave together under a stream floor, and which leave at once."""

from __future__ import annotations

import asyncio

import pytest

from replicas.output_pacer import Errors, OutputPacer, Outputs
from replicas.request import EngineError, TokenBatch

pytestmark = pytest.mark.asyncio


class Sink:
    def __init__(self) -> None:
        self.messages: list[tuple[Outputs, Errors]] = []

    def __call__(self, outputs: Outputs, errors: Errors) -> None:
        self.messages.append((outputs, errors))

    def tokens(self, i: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(rid, b.token_ids) for rid, b in self.messages[i][0]]


def _b(token: int, finish: str | None = None, choice: int = 0) -> TokenBatch:
    return TokenBatch(choice, (token,), finish_reason=finish)


async def test_without_a_floor_every_step_goes_as_it_comes() -> None:
    sink = Sink()
    pacer = OutputPacer(sink)
    pacer.put([("a", _b(1))], [])
    pacer.put([("a", _b(2))], [])
    assert [sink.tokens(i) for i in range(2)] == [[("a", (1,))], [("a", (2,))]]


async def test_under_a_floor_steps_wait_for_it_and_first_and_last_batches_go_at_once() -> None:
    sink = Sink()
    pacer = OutputPacer(sink, floor_s=0.2)
    pacer.put([("a", _b(1))], [])  # a's first batch: at once
    assert sink.tokens(0) == [("a", (1,))]
    for token in (2, 3, 4):  # three "steps" within the floor: held
        await asyncio.sleep(0.01)
        pacer.put([("a", _b(token))], [])
    assert len(sink.messages) == 1
    pacer.put([("a", _b(5)), ("b", _b(9))], [])  # b's first batch takes a's along
    assert sink.tokens(1) == [("a", (2,)), ("a", (3,)), ("a", (4,)), ("a", (5,)), ("b", (9,))]
    pacer.put([("b", _b(10))], [])
    pacer.put([("a", _b(6, "length"))], [])  # a's last
    assert sink.tokens(2) == [("b", (10,)), ("a", (6,))]
    # a's second choice is new; b's failure goes at once
    pacer.put([("a", _b(1, choice=1))], [])
    assert len(sink.messages) == 4
    pacer.put([], [("b", EngineError("boom"))])
    assert len(sink.messages) == 5 and sink.messages[4][1][0][0] == "b"


async def test_held_outputs_leave_by_the_floor_without_a_next_step() -> None:
    sink = Sink()
    pacer = OutputPacer(sink, floor_s=0.05)
    pacer.put([("a", _b(1))], [])
    pacer.put([("a", _b(2))], [])
    assert len(sink.messages) == 1
    await asyncio.sleep(0.2)
    assert sink.tokens(1) == [("a", (2,))]


async def test_finished_failed_and_aborted_requests_are_forgotten() -> None:
    sink = Sink()
    pacer = OutputPacer(sink, floor_s=10.0)
    pacer.put([("a", _b(1)), ("b", _b(1)), ("c", _b(1))], [])
    pacer.put([("a", _b(2, "stop"))], [("b", EngineError("x"))])
    pacer.forget("c")
    assert pacer._open == {}
    # a request id seen again (a retry) starts over: its first batch is urgent
    pacer.put([("c", _b(1))], [])
    assert len(sink.messages) == 3
