"""Channels: one stream per (ingress replica, model replica) that carries all of that ingress's
requests' tokens, at most one message per engine step.

Streaming every request's tokens through its own Ray Serve call costs a Ray message per request
per step (~0.4 ms of the replica's CPU and more in the ingress, each): at 256 streams that is most
of a core, which is why a message budget used to group tokens into bursts. Over a channel the
replica sends one message per step to each ingress, holding every one of its requests' new
batches, and the ingress fans them out locally. Under a message budget with a floor (CPUs by
default: each request waits at least 40 ms between SSE events, serve_app/channels.py) the
replica too sends at most one message per floor, except that a request's first and last batches
go at once: the ingress would hold the tokens that long anyway, and on 2 cores a Ray message
each ~9 ms step (1.7 ms of the front's CPU and as much of the ingress's, at one stream) took the
cores from the engine's threads.

A request's own `generate` call stays open for its lifetime: it is what Serve routes, counts
against `max_ongoing_requests` and cancels when the client leaves (which aborts the request), and
it carries the request's failure. On a replica that has this ingress's channel it yields one
`Channeled` marker and then nothing until the request ends; its batches go over the channel. On
one that has not, it first yields `NeedChannel`, on which the ingress opens one, and waits up to
`OPEN_WAIT_S` for it before the request starts (one Serve call, milliseconds); only if none comes
does it stream the request's batches itself.

The channel call is pinned to its replica by `replicas/router.py` (`ChannelOpen` names it). A
channel with no request on it for `IDLE_S` ends (the ingress opens it again with its next request
there): Serve drains a replica it stops by waiting for its calls, and a channel never ends by
itself."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from replicas import core_protocol as proto
from replicas.request import TokenBatch

IDLE_S = 2.0
OPEN_WAIT_S = 2.0


@dataclass(frozen=True)
class ChannelOpen:
    """The argument of a channel call: the replica it must reach and the ingress it serves."""
    replica: str
    ingress: str


@dataclass(frozen=True)
class NeedChannel:
    """What `generate` yields first on a replica without the ingress's channel: open one."""
    replica: str


@dataclass(frozen=True)
class Channeled:
    """What a channeled request's `generate` yields first: its batches come over the channel
    of the ingress from this replica."""
    replica: str | None


class Channel:
    """The replica's side: the rows (`core_protocol.batch_row`) of the ingress's requests
    gathered between two sends, sent as one msgpack message, at most one per `floor_s` unless a
    row is urgent (a choice's first or last batch)."""

    __slots__ = ("_rows", "_sent", "_urgent", "_wake", "closed", "floor_s")

    def __init__(self, floor_s: float = 0.0) -> None:
        self.floor_s = floor_s
        self._rows: list[list] = []
        self._urgent = False
        self._sent = float("-inf")  # loop time of the last message
        self._wake = asyncio.Event()
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    def put_row(self, row: list, urgent: bool = True) -> None:
        # (a sender waiting with no rows must learn when the first one is due)
        if urgent or not self._rows:
            self._wake.set()
        self._urgent = self._urgent or urgent
        self._rows.append(row)

    async def take(self, idle_s: float | None = None) -> bytes | None:
        """Waits for rows and for them to be due, then returns all of them as one message (one
        engine step's when the reader keeps up and there is no floor); None after `idle_s`
        without any."""
        loop = asyncio.get_running_loop()
        while not self.closed:
            if self._rows:
                wait: float | None = (0.0 if self._urgent
                                      else self._sent + self.floor_s - loop.time())
                if wait <= 0:
                    break
            else:
                wait = idle_s
            self._wake.clear()
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                if not self._rows:
                    return None
        rows, self._rows, self._urgent = self._rows, [], False
        self._sent = loop.time()
        return proto.encode(rows)


def decode(message: bytes) -> dict[str, list[TokenBatch]]:
    """A channel message -> each request's batches, in order."""
    out: dict[str, list[TokenBatch]] = {}
    for row in proto.decode(message):
        out.setdefault(row[0], []).append(proto.row_batch(row))
    return out
