"""serve_app/channels.py without Ray: a request's batches from its ingress's channel or from its
own call, in order, coalesced when the reader falls behind, ended by its choices' last batches."""

from __future__ import annotations

import asyncio
import time

import pytest

from replicas import core_protocol as proto
from replicas.channel import Channeled, ChannelOpen, NeedChannel
from replicas.request import EngineError, TokenBatch
from serve_app.channels import ChannelHub, Subscription


class Call:
    """Stands in for Serve's streaming response: yields what is put, ends at None."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> object:
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


def batch(choice: int, *tokens: int, finish: str | None = None,
          replica: str | None = None) -> TokenBatch:
    return TokenBatch(choice, tokens, finish_reason=finish, replica=replica)


def subscribed(n: int = 1, min_tokens: int = 1) -> tuple[ChannelHub, Subscription, Call]:
    """A hub that records the channels it is asked to open (`hub.opened`), and one request
    subscribed on it with its call attached."""
    hub = ChannelHub(handle=None, ingress="ingress-1")
    hub.opened = []  # type: ignore[attr-defined]
    hub.open = hub.opened.append  # type: ignore[attr-defined, method-assign]
    sub = hub.subscribe("r1", n=n, min_tokens=min_tokens)
    call = Call()
    sub.attach(call)
    return hub, sub, call


async def test_a_channeled_request_ends_with_its_choices_last_batches() -> None:
    hub, sub, call = subscribed(n=2)
    # the channel's first batches may come before the call's marker does
    sub.from_channel((batch(0, 1), batch(1, 2)))
    assert await anext(sub) == (batch(0, 1), batch(1, 2))
    call.queue.put_nowait(Channeled("replica-a"))
    sub.from_channel((batch(0, 3, finish="length"),))
    assert await anext(sub) == (batch(0, 3, finish="length"),)
    await asyncio.sleep(0)  # the call's reader takes the marker
    assert sub.replica == "replica-a" and hub.opened == []
    sub.from_channel((batch(1, 4, finish="stop"),))
    assert await anext(sub) == (batch(1, 4, finish="stop"),)
    with pytest.raises(StopAsyncIteration):  # without waiting for the call to end
        await anext(sub)
    assert hub.subscriptions == {}
    call.queue.put_nowait(None)


async def test_a_reader_that_falls_behind_gets_one_batch_per_choice() -> None:
    hub, sub, _ = subscribed(n=1)
    for t in range(5):
        sub.from_channel((batch(0, t),))
    assert await anext(sub) == (TokenBatch(0, (0, 1, 2, 3, 4)),)


async def test_a_request_asks_for_the_channel_and_without_it_streams_over_its_call() -> None:
    hub, sub, call = subscribed(n=1)
    call.queue.put_nowait(NeedChannel("replica-b"))  # the replica has none from this ingress
    call.queue.put_nowait((batch(0, 1, replica="replica-b"),))  # and none came in time
    assert await anext(sub) == (batch(0, 1, replica="replica-b"),)
    assert hub.opened == ["replica-b"] and sub.replica == "replica-b"
    call.queue.put_nowait((batch(0, 2, finish="length"),))
    call.queue.put_nowait(None)
    assert await anext(sub) == (batch(0, 2, finish="length"),)
    with pytest.raises(StopAsyncIteration):
        await anext(sub)
    assert hub.subscriptions == {}


async def test_the_calls_failure_comes_after_what_arrived_before_it() -> None:
    hub, sub, call = subscribed(n=1)
    call.queue.put_nowait(Channeled("replica-a"))
    sub.from_channel((batch(0, 1),))
    call.queue.put_nowait(EngineError("the engine failed", status=503))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert await anext(sub) == (batch(0, 1),)
    with pytest.raises(EngineError, match="engine failed"):
        await anext(sub)
    assert hub.subscriptions == {}


async def test_cancel_aborts_the_call_and_unsubscribes() -> None:
    hub, sub, call = subscribed(n=1)
    sub.cancel()
    assert call.cancelled and hub.subscriptions == {}
    sub.from_channel((batch(0, 1),))  # a late channel message for it is dropped by the hub


async def test_after_a_choices_first_batch_a_step_waits_for_the_stream_interval() -> None:
    _, sub, _ = subscribed(min_tokens=3)
    sub.from_channel((batch(0, 1),))
    assert await anext(sub) == (batch(0, 1),)  # the first batch at once
    sub.from_channel((batch(0, 2),))
    sub.from_channel((batch(0, 3),))
    step = asyncio.ensure_future(anext(sub))
    await asyncio.sleep(0)
    assert not step.done()
    sub.from_channel((batch(0, 4),))
    assert await step == (TokenBatch(0, (2, 3, 4)),)
    sub.from_channel((batch(0, 5, finish="length"),))  # the end at once
    assert await anext(sub) == (batch(0, 5, finish="length"),)


async def test_under_a_message_budget_a_request_waits_its_share_between_messages() -> None:
    hub, first, _ = subscribed()
    hub.pace = (8.0, 0.0)  # 8 messages a second for all of the ingress's producing streams
    subs = [first, *(hub.subscribe(f"r{i}", n=1) for i in range(1, 4))]
    for i, sub in enumerate(subs):
        if sub is not first:
            sub.attach(Call())
        sub.from_channel((batch(0, i),))
        assert await anext(sub) == (batch(0, i),)  # a first batch at once
    assert hub.producing == 4
    sub = subs[3]
    assert sub.box.hold_until - time.monotonic() > 0.4  # its share: 4 streams / 8 a second
    sub.from_channel((batch(0, 1),))
    step = asyncio.ensure_future(anext(sub))
    await asyncio.sleep(0.01)
    assert not step.done()  # held
    sub.box.hold_until = time.monotonic() - 1  # the hold passes: the next output ends it
    sub.from_channel((batch(0, 2),))
    assert await step == (TokenBatch(0, (1, 2)),)
    sub.from_channel((batch(0, 3, finish="length"),))  # held again, but an end goes at once
    assert await anext(sub) == (batch(0, 3, finish="length"),)
    with pytest.raises(StopAsyncIteration):
        await anext(sub)
    assert hub.producing == 3


class Handle:
    """Stands in for the model's handle: each channel call it makes is a `Call`."""

    def __init__(self) -> None:
        self.calls: list[tuple[ChannelOpen, Call]] = []

    @property
    def channel(self) -> Handle:
        return self

    def remote(self, opening: ChannelOpen) -> Call:
        self.calls.append((opening, call := Call()))
        return call


async def test_a_channel_asked_for_while_its_end_is_on_the_way_opens_again() -> None:
    handle = Handle()
    hub = ChannelHub(handle, ingress="ingress-1")
    hub.open("replica-a")
    await asyncio.sleep(0)
    [(opening, first)] = handle.calls
    assert opening == ChannelOpen("replica-a", "ingress-1")
    first.queue.put_nowait(proto.encode([]))  # open
    await asyncio.sleep(0)
    hub.open("replica-a")  # a request there asked: the replica has ended it, idle
    assert len(handle.calls) == 1
    first.queue.put_nowait(None)  # the end arrives
    for _ in range(3):
        await asyncio.sleep(0)
    assert [c[0] for c in handle.calls] == [opening, opening] and "replica-a" in hub.readers
    handle.calls[1][1].queue.put_nowait(None)  # that one ends too, nobody asked: closed
    for _ in range(3):
        await asyncio.sleep(0)
    assert hub.readers == {} and len(handle.calls) == 2


class _Choice:
    """What `Generation.deltas` reads of a choice's state: done at its last batch."""

    def __init__(self, index: int) -> None:
        self.index, self.done, self.stopped_at, self.stop_sent = index, False, None, False

    def on_batch(self, b: TokenBatch) -> tuple[int, ...]:
        self.done = b.finish_reason is not None
        return b.token_ids


async def test_a_request_whose_choices_all_ended_leaves_its_call_to_end_by_itself() -> None:
    """Cancelling a call whose replica has finished it is one more RPC each way for nothing;
    a reader that leaves before the end still cancels it, so the replica frees the request."""
    from serve_app.ingress import Generation

    for leaves in (False, True):
        hub, sub, call = subscribed(n=2)
        call.queue.put_nowait(Channeled("replica-a"))
        sub.from_channel((batch(0, 1), batch(1, 2)))
        gen = Generation(sub, await anext(sub), "r1", board=None)  # type: ignore[arg-type]
        deltas = gen.deltas([_Choice(0), _Choice(1)], timeout=5.0)
        assert [d async for _, d in _take(deltas, 2)] == [(1,), (2,)]
        if leaves:
            await deltas.aclose()
        else:
            sub.from_channel((batch(0, 3, finish="length"), batch(1, 4, finish="stop")))
            assert [d async for _, d in deltas] == [(3,), (4,)]
        assert call.cancelled is leaves and hub.subscriptions == {}
        call.queue.put_nowait(None)


class _StoppingChoice(_Choice):
    """Stops (as a stop string would) at token 9: done, the client keeps what came before."""

    def on_batch(self, b: TokenBatch) -> tuple[int, ...]:
        if 9 in b.token_ids:
            self.done, self.stopped_at = True, b.token_ids.index(9)
            return b.token_ids[:self.stopped_at]
        return super().on_batch(b)


class _Board:
    def __init__(self) -> None:
        self.stops: list[tuple[str, str, int, int]] = []

    def stop_choice(self, replica: str, request_id: str, choice: int, kept: int) -> bool:
        self.stops.append((replica, request_id, choice, kept))
        return True


async def test_a_stop_found_before_the_replica_is_known_is_sent_once_it_is() -> None:
    """A channeled request's first batches can come before its call names the replica: a stop
    string found in them still reaches the replica, which ends the choice and takes the tokens
    past the stop off its counters (the call is not cancelled, which would leave them there)."""
    from serve_app.ingress import Generation

    for n in (1, 2):
        board = _Board()
        hub, sub, call = subscribed(n=n)
        sub.from_channel(tuple(batch(i, 1, 9, 2) for i in range(n)))  # choice 0 stops at 9
        gen = Generation(sub, await anext(sub), "r1", board=board)  # type: ignore[arg-type]
        states = [_StoppingChoice(0)] + [_Choice(i) for i in range(1, n)]
        deltas = gen.deltas(states, timeout=5.0)
        assert [d async for _, d in _take(deltas, n)] == [(1,)] + [(1, 9, 2)] * (n - 1)
        assert board.stops == []  # the replica is not known yet
        call.queue.put_nowait(Channeled("replica-a"))
        if n == 2:
            sub.from_channel((batch(1, 3, finish="length"),))
        assert [d async for _, d in deltas] == [(3,)] * (n - 1)
        for _ in range(3):
            await asyncio.sleep(0)  # the drain
        assert board.stops == [("replica-a", "r1", 0, 1)]
        assert not call.cancelled
        sub.from_channel((batch(0, 4, finish="stop"),))  # the replica ends the choice
        call.queue.put_nowait(None)
        for _ in range(3):
            await asyncio.sleep(0)
        assert not call.cancelled and hub.subscriptions == {}


async def test_the_timeout_fires_where_the_stream_waits_after_what_came_before_it() -> None:
    """One timer a request: at its end the batches that arrived first are still delivered, then
    the wait for the next one is a 408 and the call is cancelled, so the replica frees it."""
    from serve_app.errors import APIError
    from serve_app.ingress import Generation

    hub, sub, call = subscribed(n=1)
    call.queue.put_nowait(Channeled("replica-a"))
    sub.from_channel((batch(0, 1),))
    gen = Generation(sub, await anext(sub), "r1", board=None)  # type: ignore[arg-type]
    deltas = gen.deltas([_Choice(0)], timeout=0.2)
    assert [d async for _, d in _take(deltas, 1)] == [(1,)]
    sub.from_channel((batch(0, 2),))
    await asyncio.sleep(0.3)  # the limit passes while the consumer is busy elsewhere
    assert [d async for _, d in _take(deltas, 1)] == [(2,)]  # what came before it first
    with pytest.raises(APIError) as error:
        await anext(deltas)
    assert error.value.status == 408 and error.value.param == "inference_timeout"
    assert call.cancelled and hub.subscriptions == {}
    call.queue.put_nowait(None)


async def _take(it, n: int):
    for _ in range(n):
        yield await anext(it)
