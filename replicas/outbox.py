"""Outbox: one request's outputs between where they arrive and the coroutine that sends them on:
the engine core's step messages and the replica's `generate`, and the ingress's channel messages
and the request's SSE stream (serve_app/channels.py).

Each arrival appends that request's `TokenBatch`es; the consumer is woken only when a message is
due: an urgent item (a choice's first batch, its finish, an error), or, once its hold time has
passed, enough tokens of one choice. A held request thus costs the loop a list append, not a
coroutine wake-up: with hundreds of streams, waking every consumer every step took more of the
process's GIL than the step itself. Holds end at the request's next output, not by a timer."""

from __future__ import annotations

import asyncio
import time

from replicas.channel import Channel
from replicas.request import TokenBatch


class Outbox:
    __slots__ = ("_counts", "_items", "_seen", "_urgent", "_waiter", "channel", "hold_until",
                 "min_tokens")

    def __init__(self) -> None:
        self.hold_until = 0.0  # time.monotonic() before which non-urgent items wait
        self.min_tokens = 1  # tokens one choice gathers before a non-urgent message
        # set when the request's batches go over its ingress's channel (replicas/channel.py):
        # then only its choices' last batches and its failure come here, to end `generate`
        self.channel: Channel | None = None
        self._items: list[TokenBatch | BaseException] = []
        self._counts: dict[int, int] = {}  # choice -> tokens waiting
        self._seen: set[int] = set()  # choices that have had a batch
        self._urgent = False
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: TokenBatch | BaseException) -> None:
        self._items.append(item)
        urgent = True
        if isinstance(item, TokenBatch):
            choice = item.choice_index
            self._counts[choice] = self._counts.get(choice, 0) + len(item.token_ids)
            urgent = choice not in self._seen or item.finish_reason is not None
            self._seen.add(choice)
        self._urgent = self._urgent or urgent
        waiter = self._waiter
        if waiter is not None and not waiter.done() and self._due():
            waiter.set_result(None)

    def _due(self) -> bool:
        if not self._items:
            return False
        if self._urgent:
            return True
        return (max(self._counts.values(), default=0) >= self.min_tokens
                and time.monotonic() >= self.hold_until)

    async def take(self) -> list[TokenBatch | BaseException]:
        """Waits until a message is due, then returns everything waiting."""
        while not self._due():
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        self._counts.clear()
        self._urgent = False
        return items
