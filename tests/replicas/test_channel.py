"""The replica's side of a channel (replicas/channel.py), without Ray: when its rows are sent."""

from __future__ import annotations

import asyncio

import pytest

from replicas import core_protocol as proto
from replicas.channel import Channel

pytestmark = pytest.mark.asyncio


def _row(rid: str, token: int, finish: str | None = None) -> list:
    return [rid, 0, [token], finish, None, 4, 0, 0, 0]


async def test_every_wake_up_sends_what_has_come() -> None:
    channel = Channel()
    channel.put_row(_row("a", 1))
    channel.put_row(_row("b", 2))
    assert [r[2] for r in proto.decode(await channel.take(1.0))] == [[1], [2]]
    channel.put_row(_row("a", 3))
    assert [r[2] for r in proto.decode(await channel.take(1.0))] == [[3]]


async def test_a_waiting_take_wakes_for_the_first_row() -> None:
    channel = Channel()
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, channel.put_row, _row("a", 7))
    started = loop.time()
    assert [r[2] for r in proto.decode(await channel.take(5.0))] == [[7]]
    assert loop.time() - started < 1.0


async def test_an_idle_channel_says_so_and_a_closed_one_gives_what_is_left() -> None:
    channel = Channel()
    assert await channel.take(0.05) is None
    channel.put_row(_row("c", 3))
    channel.close()
    assert [r[0] for r in proto.decode(await channel.take(0.05))] == ["c"]
    assert proto.decode(await channel.take(0.05)) == []
