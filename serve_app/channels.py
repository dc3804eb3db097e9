"""The ingress's side of channels (replicas/channel.py): per served model, one channel open to each
model replica its requests have reached, and each request's batches handed to it from there or
from its own `generate` call.

A request is subscribed before its call is made (its first batches may come over the channel
before the call's `Channeled` marker does). A request that reaches a replica without this
ingress's channel asks for one (`NeedChannel`) and waits for it there; only if none opens in time
does it stream over its own call. A channeled request ends when every choice has had its last
batch; its call still carries its failure and is what is cancelled to abort it. Where this
ingress runs in Ray, its channels are direct: each open names this hub's inbox
(serve_app/inbox.py), and the cores of replicas on its node send their rows there."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

from replicas.channel import Channeled, ChannelOpen, NeedChannel, decode, node_id
from replicas.outbox import Outbox
from replicas.request import EngineError, TokenBatch, coalesce
from serve_app.inbox import Inbox

logger = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 10.0  # for a channel's first (empty) message


class _End(Exception):
    """The request's last batch has been queued."""


class Subscription:
    """One request's batches, from its channel or its call, iterated like the call itself.

    Each step takes everything that has arrived, one batch per choice, from an `Outbox`: a
    choice's first batch, its end and a failure at once; otherwise `min_tokens` of one choice
    (vLLM's stream interval) and, under a message budget, the request's share of it (the hub's
    `pace`). An ingress that falls behind sends fewer, larger SSE events rather than queueing."""

    def __init__(self, hub: ChannelHub, request_id: str, n: int, min_tokens: int = 1) -> None:
        self.hub = hub
        self.request_id = request_id
        self.call: Any = None
        self.replica: str | None = None
        # set once `replica` is known, or once the call has ended without naming it: a
        # channeled request's first batches can come before its call's `Channeled` does
        self.replica_known = asyncio.Event()
        self.box = Outbox()
        self.box.min_tokens = min_tokens
        self._unfinished = n
        self._later: list[TokenBatch | BaseException] = []  # taken, behind a failure or end
        self._producing = False
        self._watcher: asyncio.Task | None = None

    def attach(self, call: Any) -> None:
        """The request's own call, made after it was subscribed."""
        self.call = call
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def _put(self, batches: list[TokenBatch] | tuple[TokenBatch, ...]) -> None:
        for b in batches:
            self.box.put(b)

    def from_channel(self, batches: list[TokenBatch] | tuple[TokenBatch, ...]) -> None:
        self._put(batches)
        self._unfinished -= sum(b.finish_reason is not None for b in batches)
        if self._unfinished <= 0:
            self.box.put(_End())

    async def _watch(self) -> None:
        """Reads the request's own call: its batches (not channeled), its failure, its end."""
        channeled = False
        try:
            async for item in self.call:
                if isinstance(item, EngineError):  # its failure, sent as an item
                    raise item
                if isinstance(item, NeedChannel):
                    self.hub.open(item.replica)
                    continue
                if isinstance(item, Channeled):
                    channeled = True
                    self.replica = item.replica
                    self.replica_known.set()
                    continue
                if self.replica is None and item:
                    self.replica = item[0].replica
                    self.replica_known.set()
                self._put(item)
            if not channeled:
                self.box.put(_End())
        except Exception as exc:  # noqa: BLE001 (the call's failure is the request's)
            self.box.put(exc)
        finally:
            self.replica_known.set()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> tuple[TokenBatch, ...]:
        items, self._later = self._later or await self.box.take(), []
        taken: list[TokenBatch] = []
        for i, item in enumerate(items):
            if isinstance(item, BaseException):
                if taken:  # what came before it first
                    self._later = items[i:]
                    break
                self.close()
                if isinstance(item, _End):
                    raise StopAsyncIteration
                raise item
            taken.append(item)
        hub = self.hub
        if not self._producing:
            self._producing = True
            hub.producing += 1
        budget, floor = hub.pace or (0.0, 0.0)
        if budget or floor:
            share = hub.producing / budget if budget else 0.0
            self.box.hold_until = time.monotonic() + max(share, floor)
        return coalesce(taken)

    def cancel(self) -> None:
        """Aborts the request on its replica (cancelling its call) and stops listening."""
        self.close()
        if self._watcher is not None:
            self._watcher.cancel()
        if self.call is not None:
            with contextlib.suppress(Exception):  # cancel re-raises the call's own failure
                self.call.cancel()

    def expire(self) -> None:
        """The request's time is up: the next wait for a batch raises TimeoutError (after the
        batches already here)."""
        self.box.put(TimeoutError())

    def close(self) -> None:
        """Stops taking the channel's batches (the call, if it still runs, ends by itself)."""
        if self.hub.subscriptions.get(self.request_id) is self:
            del self.hub.subscriptions[self.request_id]
        if self._producing:
            self._producing = False
            self.hub.producing -= 1


class ChannelHub:
    """One served model's channels from this ingress, by model replica."""

    def __init__(self, handle: Any, ingress: str) -> None:
        self.handle = handle  # the model's handle, options(stream=True)
        self.ingress = ingress
        self.subscriptions: dict[str, Subscription] = {}
        self.readers: dict[str, asyncio.Task] = {}
        self.again: set[str] = set()  # replicas that asked for a channel while one was read
        self.producing = 0  # subscriptions that have had output: they share the budget
        # (messages per second shared by the producing subscriptions, 0: none; the least wait
        # between two of one request's messages), as the model's replicas report it (None: no
        # report yet, no budget meanwhile)
        self.pace: tuple[float, float] | None = None
        # where the engine cores of this node send rows directly (opened with the first
        # channel, where this ingress runs in Ray: serve_app/inbox.py)
        self.inbox: Inbox | None = None

    def deliver(self, message: bytes) -> None:
        """A channel message, from a replica's channel call or a core's direct send."""
        subs = self.subscriptions
        for request_id, batches in decode(message).items():
            sub = subs.get(request_id)
            if sub is not None:
                sub.from_channel(batches)

    def _direct(self) -> tuple[str | None, str | None]:
        """(this ingress's inbox address, its Ray node): where cores may send rows directly."""
        node = node_id()
        if node is None:
            return None, None
        if self.inbox is None:
            try:
                self.inbox = Inbox(self.deliver)
            except Exception as exc:  # noqa: BLE001  (rows then come over the channel calls)
                logger.warning("no inbox for direct channels: %r", exc)
                return None, None
        return self.inbox.address, node

    def subscribe(self, request_id: str, n: int, min_tokens: int = 1) -> Subscription:
        """Before the request's call is made: its batches may come over a channel first."""
        sub = self.subscriptions[request_id] = Subscription(self, request_id, n, min_tokens)
        return sub

    def open(self, replica: str | None) -> None:
        """Opens a channel to `replica` (a request there asked for one). If this ingress still
        reads one, either it is being opened or the replica has just ended it for idleness and
        its end is on the way here: it is opened again when that reader ends."""
        if replica is None:
            return
        if replica in self.readers:
            self.again.add(replica)
            return
        task = asyncio.get_running_loop().create_task(self._read(replica))
        self.readers[replica] = task

    async def _read(self, replica: str) -> None:
        # a call of its own, not a child of the request that opened it (Serve cancels those
        # with their request)
        from ray.serve.context import _set_request_context
        _set_request_context(_internal_request_id=uuid.uuid4().hex)
        call = self.handle.channel.remote(ChannelOpen(replica, self.ingress, *self._direct()))
        ended = False  # by the replica, idle
        try:
            async with asyncio.timeout(OPEN_TIMEOUT_S):
                opened = await anext(call, None)
            if opened is None:  # the replica is gone: another one ended the call at once
                logger.info("no channel to replica %s: it is gone", replica)
                return
            async for message in call:
                self.deliver(message)
            ended = True
        except Exception as exc:  # noqa: BLE001 (its requests fail through their own calls)
            logger.warning("channel to replica %s ended: %r", replica, exc)
        finally:
            with contextlib.suppress(Exception):
                call.cancel()
            if self.readers.get(replica) is asyncio.current_task():
                del self.readers[replica]
                if replica in self.again:  # a request there asked meanwhile
                    self.again.discard(replica)
                    if ended:
                        self.open(replica)
