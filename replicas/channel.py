"""Channels: one stream per (ingress replica, model replica) that carries all of that ingress's
requests' tokens: one message per message of the engine core (a step's outputs, or a floor's).

Streaming every request's tokens through its own Ray Serve call costs a Ray message per request
per step (~0.4 ms of the replica's CPU and more in the ingress, each): at 256 streams that is most
of a core, which is why a message budget used to group tokens into bursts. Over a channel the
replica sends one message per step to each ingress, holding every one of its requests' new
batches, and the ingress fans them out locally. Under a stream floor the core itself gathers the
steps of a floor into one message (replicas/output_pacer.py), and the channel forwards what each
of those brings.

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
itself.

**Direct channels.** An ingress on the same Ray node as the replica names a socket of its own in
`ChannelOpen` (serve_app/inbox.py), and the replica's engine core then sends that ingress's rows
there itself (replicas/ingress_routes.py): the front relays nothing per step, and no Ray message
carries tokens. The channel call stays open all the same, carrying nothing: it is how the replica
learns that the ingress is gone (Serve cancels it), and how the ingress learns that the replica
is. The front still gets each choice's last batch, to end the request's `generate`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from replicas import core_protocol as proto
from replicas.request import TokenBatch

IDLE_S = 2.0
OPEN_WAIT_S = 2.0


@dataclass(frozen=True)
class ChannelOpen:
    """The argument of a channel call: the replica it must reach and the ingress it serves;
    and where that ingress takes rows directly (a ZeroMQ address only its node can reach, on
    the Ray node `node`), or None."""
    replica: str
    ingress: str
    address: str | None = None
    node: str | None = None


def node_id() -> str | None:
    """This process's Ray node, None outside Ray."""
    try:
        import ray
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001  (no runtime context: not a Ray worker)
        return None


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
    """The replica's side: the rows (`core_protocol.batch_row`) of the ingress's requests that
    came since the last send, sent as one msgpack message; none on a `direct` one (the core
    sends them to the ingress's socket)."""

    __slots__ = ("_rows", "_wake", "closed", "direct")

    def __init__(self, direct: bool = False) -> None:
        self._rows: list[list] = []
        self._wake = asyncio.Event()
        self.closed = False
        self.direct = direct

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    def put_row(self, row: list) -> None:
        self._rows.append(row)
        self._wake.set()

    async def take(self, idle_s: float | None = None) -> bytes | None:
        """Waits for rows, then returns all of them as one message (one core message's when the
        reader keeps up); None after `idle_s` without any."""
        while not self._rows and not self.closed:
            self._wake.clear()
            try:
                async with asyncio.timeout(idle_s):
                    await self._wake.wait()
            except TimeoutError:
                if not self._rows:
                    return None
        rows, self._rows = self._rows, []
        return proto.encode(rows)


def decode(message: bytes) -> dict[str, list[TokenBatch]]:
    """A channel message -> each request's batches, in order."""
    out: dict[str, list[TokenBatch]] = {}
    for row in proto.decode(message):
        out.setdefault(row[0], []).append(proto.row_batch(row))
    return out
