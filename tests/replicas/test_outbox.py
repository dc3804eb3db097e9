"""Outbox: when the engine's outputs wake the replica's generate, and what they carry."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from replicas.outbox import Outbox
from replicas.request import TokenBatch


async def _woken(outbox: Outbox, action) -> list | None:
    """What a waiting take() returns after `action` (and one turn of the loop), or None when it
    is still waiting (it is then cancelled, leaving the items in the outbox)."""
    task = asyncio.ensure_future(outbox.take())
    await asyncio.sleep(0)
    action()
    await asyncio.sleep(0)
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def test_urgent_items_wake_at_once_held_ones_wait_for_the_next_output() -> None:
    box = Outbox()
    box.hold_until = time.monotonic() + 3600
    # a choice's first batch is urgent (time to first token)
    assert await _woken(box, lambda: box.put(TokenBatch(0, (1,)))) == [TokenBatch(0, (1,))]

    box.hold_until = time.monotonic() + 3600
    assert await _woken(box, lambda: box.put(TokenBatch(0, (2,)))) is None
    assert await _woken(box, lambda: box.put(TokenBatch(0, (3,)))) is None
    # the finish is urgent and takes what was held with it, in order
    items = await _woken(box, lambda: box.put(TokenBatch(0, (4,), finish_reason="length")))
    assert [b.token_ids for b in items] == [(2,), (3,), (4,)]


async def test_a_passed_hold_wakes_on_the_next_output() -> None:
    box = Outbox()
    box.put(TokenBatch(0, (4,)))
    await box.take()
    box.hold_until = time.monotonic() - 1
    assert await _woken(box, lambda: box.put(TokenBatch(0, (5,)))) == [TokenBatch(0, (5,))]


async def test_min_tokens_counts_per_choice() -> None:
    box = Outbox()
    box.put(TokenBatch(0, ()))
    box.put(TokenBatch(1, ()))
    await box.take()  # (first batches go at once)
    box.min_tokens = 3
    assert await _woken(box, lambda: box.put(TokenBatch(0, (1, 2)))) is None
    assert await _woken(box, lambda: box.put(TokenBatch(1, (7, 8)))) is None
    items = await _woken(box, lambda: box.put(TokenBatch(1, (9,))))
    assert [b.token_ids for b in items] == [(1, 2), (7, 8), (9,)]


async def test_an_error_is_urgent() -> None:
    box = Outbox()
    box.put(TokenBatch(0, ()))
    await box.take()
    box.hold_until = time.monotonic() + 3600
    box.put(TokenBatch(0, (1,)))
    items = await _woken(box, lambda: box.put(RuntimeError("shard died")))
    assert items[0] == TokenBatch(0, (1,)) and isinstance(items[-1], RuntimeError)


@pytest.mark.parametrize("first", [True, False])
async def test_take_returns_at_once_when_already_due(first: bool) -> None:
    box = Outbox()
    if not first:
        box.put(TokenBatch(0, ()))
        await box.take()
    box.put(TokenBatch(0, (1,)))  # hold_until 0: already passed
    assert await asyncio.wait_for(box.take(), 1) == [TokenBatch(0, (1,))]
