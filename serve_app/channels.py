"""The ingress's side of channels (replicas/channel.py): per served model, one channel open to each
model replica its requests have reached, and each request's batches handed to it from there or
from its own `generate` call.

A request is subscribed before its call is made (its first batches may come over the channel
before the call's `Channeled` marker does). A request that reached a replica without this
ingress's channel streams over its own call, and opens the channel for the requests after it. A
channeled request ends when every choice has had its last batch; its call still carries its
failure and is what is cancelled to abort it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

from replicas.channel import Channeled, ChannelOpen
from replicas.request import TokenBatch, coalesce

logger = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 10.0  # for a channel's first (empty) message
_END = object()  # the request's last batch has been queued


class Subscription:
    """One request's batches, from its channel or its call, iterated like the call itself. Each
    step takes everything that has arrived, one batch per choice: an ingress that falls behind
    sends fewer, larger SSE events rather than queueing up. After a choice's first batch, a step
    waits for `min_tokens` of one choice (vLLM's stream interval), or its end."""

    def __init__(self, hub: ChannelHub, request_id: str, n: int, min_tokens: int = 1) -> None:
        self.hub = hub
        self.request_id = request_id
        self.min_tokens = min_tokens
        self.call: Any = None
        self.replica: str | None = None
        self._unfinished = n
        self._items: list[Any] = []
        self._counts: dict[int, int] = {}  # choice -> tokens waiting
        self._seen: set[int] = set()  # choices whose first batch went out
        self._urgent = False
        self._waiter: asyncio.Future[None] | None = None
        self._watcher: asyncio.Task | None = None

    def attach(self, call: Any) -> None:
        """The request's own call, made after it was subscribed."""
        self.call = call
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def _push(self, item: Any) -> None:
        self._items.append(item)
        if isinstance(item, tuple):
            counts = self._counts
            for b in item:
                counts[b.choice_index] = counts.get(b.choice_index, 0) + len(b.token_ids)
                if b.finish_reason is not None or b.choice_index not in self._seen:
                    self._urgent = True
        else:  # its end or its failure
            self._urgent = True
        if self._waiter is not None and not self._waiter.done() and self._due():
            self._waiter.set_result(None)

    def _due(self) -> bool:
        if not self._items:
            return False
        return self._urgent or max(self._counts.values(), default=0) >= self.min_tokens

    def from_channel(self, batches: tuple[TokenBatch, ...]) -> None:
        self._push(batches)
        self._unfinished -= sum(b.finish_reason is not None for b in batches)
        if self._unfinished <= 0:
            self._push(_END)

    async def _watch(self) -> None:
        """Reads the request's own call: its batches (not channeled), its failure, its end."""
        channeled = False
        try:
            async for item in self.call:
                if isinstance(item, Channeled):
                    channeled = True
                    self.replica = item.replica
                    continue
                if self.replica is None and item:
                    self.replica = item[0].replica
                    self.hub.open(self.replica)
                self._push(item)
            if not channeled:
                self._push(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 (the call's failure is the request's)
            self._push(exc)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> tuple[TokenBatch, ...]:
        while not self._due():
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._counts.clear()
        self._urgent = False
        taken: list[TokenBatch] = []
        for i, item in enumerate(self._items):
            if item is _END or isinstance(item, BaseException):
                if taken:  # what came before it first
                    self._items = self._items[i:]
                    self._urgent = True
                    return self._out(taken)
                self._items = []
                self.close()
                if item is _END:
                    raise StopAsyncIteration
                raise item
            taken.extend(item)
        self._items = []
        return self._out(taken)

    def _out(self, taken: list[TokenBatch]) -> tuple[TokenBatch, ...]:
        batches = coalesce(taken)
        self._seen.update(b.choice_index for b in batches)
        return batches

    def cancel(self) -> None:
        """Aborts the request on its replica (cancelling its call) and stops listening."""
        self.close()
        if self._watcher is not None:
            self._watcher.cancel()
        if self.call is not None:
            with contextlib.suppress(Exception):  # cancel re-raises the call's own failure
                self.call.cancel()

    def close(self) -> None:
        """Stops taking the channel's batches (the call, if it still runs, ends by itself)."""
        if self.hub.subscriptions.get(self.request_id) is self:
            del self.hub.subscriptions[self.request_id]


class ChannelHub:
    """One served model's channels from this ingress, by model replica."""

    def __init__(self, handle: Any, ingress: str) -> None:
        self.handle = handle  # the model's handle, options(stream=True)
        self.ingress = ingress
        self.subscriptions: dict[str, Subscription] = {}
        self.readers: dict[str, asyncio.Task] = {}

    def subscribe(self, request_id: str, n: int, min_tokens: int = 1) -> Subscription:
        """Before the request's call is made: its batches may come over a channel first."""
        sub = self.subscriptions[request_id] = Subscription(self, request_id, n, min_tokens)
        return sub

    def open(self, replica: str | None) -> None:
        """Opens a channel to `replica` unless one is open or opening."""
        if replica is None or replica in self.readers:
            return
        task = asyncio.get_running_loop().create_task(self._read(replica))
        self.readers[replica] = task

    async def _read(self, replica: str) -> None:
        # a call of its own, not a child of the request that opened it (Serve cancels those
        # with their request)
        from ray.serve.context import _set_request_context
        _set_request_context(_internal_request_id=uuid.uuid4().hex)
        call = self.handle.channel.remote(ChannelOpen(replica, self.ingress))
        try:
            async with asyncio.timeout(OPEN_TIMEOUT_S):
                await anext(call)
            async for message in call:
                subs = self.subscriptions
                for request_id, batches in message.items():
                    sub = subs.get(request_id)
                    if sub is not None:
                        sub.from_channel(batches)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (its requests fail through their own calls)
            logger.warning("channel to replica %s ended: %r", replica, exc)
        finally:
            with contextlib.suppress(Exception):
                call.cancel()
            if self.readers.get(replica) is asyncio.current_task():
                del self.readers[replica]

    def close(self) -> None:
        for task in list(self.readers.values()):
            task.cancel()
