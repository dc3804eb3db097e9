"""The replica's side of a channel (replicas/channel.py), without Ray: when its rows are sent."""

from __future__ import annotations

import asyncio

import pytest

from replicas import core_protocol as proto
from replicas.channel import Channel

pytestmark = pytest.mark.asyncio


def _row(rid: str, token: int, finish: str | None = None) -> list:
    return [rid, 0, [token], finish, None, 4, 0, 0, 0]


async def test_without_a_floor_every_wake_up_sends_what_has_come() -> None:
    channel = Channel()
    channel.put_row(_row("a", 1), urgent=False)
    assert [r[2] for r in proto.decode(await channel.take(1.0))] == [[1]]
    channel.put_row(_row("a", 2), urgent=False)
    assert [r[2] for r in proto.decode(await channel.take(1.0))] == [[2]]


async def test_under_a_floor_rows_wait_for_it_and_urgent_ones_go_at_once() -> None:
    loop = asyncio.get_running_loop()
    channel = Channel(floor_s=0.2)
    channel.put_row(_row("a", 1))  # a's first batch: at once
    started = loop.time()
    assert [r[2] for r in proto.decode(await channel.take(5.0))] == [[1]]
    assert loop.time() - started < 0.1

    async def produce() -> None:  # a's next tokens, one per 20 ms "step"
        for token in range(2, 6):
            await asyncio.sleep(0.02)
            channel.put_row(_row("a", token), urgent=False)
    producer = loop.create_task(produce())
    message = await channel.take(5.0)
    # one message for the four steps, a floor after the last send
    assert [r[2] for r in proto.decode(message)] == [[2], [3], [4], [5]]
    assert loop.time() - started >= 0.2
    await producer
    # b's first batch does not wait for the floor
    channel.put_row(_row("a", 6), urgent=False)
    channel.put_row(_row("b", 9))
    started = loop.time()
    assert [r[0] for r in proto.decode(await channel.take(5.0))] == ["a", "b"]
    assert loop.time() - started < 0.1


async def test_an_idle_channel_says_so_and_a_closed_one_gives_what_is_left() -> None:
    channel = Channel(floor_s=10.0)
    assert await channel.take(0.05) is None
    channel.put_row(_row("a", 1), urgent=False)
    channel.put_row(_row("a", 2, "length"))
    assert len(proto.decode(await channel.take(0.05))) == 2
    channel.put_row(_row("c", 3), urgent=False)
    channel.close()
    assert [r[0] for r in proto.decode(await channel.take(0.05))] == ["c"]
