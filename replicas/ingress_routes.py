"""IngressRoutes: the engine core's sockets to the ingresses of its node, and which request's
rows go to which (direct channels, replicas/channel.py).

A request whose ingress has a direct channel to this replica arrives with `GenerateRequest.ingress`
set; its rows then leave the core on that ingress's socket, one message per ingress per core
message (a step's, or a floor's: replicas/output_pacer.py), and only its choices' last batches go
to the front as well (they end its `generate`). Everything else goes to the front as before. A
request is forgotten when its last choice ends, it fails, or it is aborted; an ingress's socket
when the front says its channel closed (its requests are aborted then too)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replicas import core_protocol as proto
from replicas.output_pacer import Errors, Outputs
from replicas.request import GenerateRequest


@dataclass
class _Route:
    ingress: str
    choices_left: int


class IngressRoutes:
    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx  # a zmq.Context
        self._sockets: dict[str, Any] = {}  # ingress -> its PUSH socket
        self._requests: dict[str, _Route] = {}

    def handle(self, command: tuple) -> None:
        """A command from the front (core_protocol) as far as routing goes: new requests, aborts,
        channels opening and closing."""
        kind = command[0]
        if kind == proto.ADD:
            self.add(command[1])
        elif kind == proto.ABORT:
            self.forget(command[1])
        elif kind == proto.CONNECT:
            self.connect(command[1], command[2])
        elif kind == proto.DISCONNECT:
            self.disconnect(command[1])

    def connect(self, ingress: str, address: str) -> None:
        import zmq

        self.disconnect(ingress)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop a row; the channel's close ends it all
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        self._sockets[ingress] = sock

    def disconnect(self, ingress: str) -> None:
        sock = self._sockets.pop(ingress, None)
        if sock is not None:
            sock.close(linger=0)
        for rid in [r for r, route in self._requests.items() if route.ingress == ingress]:
            del self._requests[rid]

    def add(self, request: GenerateRequest) -> None:
        if request.ingress is not None and request.ingress in self._sockets:
            self._requests[request.request_id] = _Route(request.ingress, request.n)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def split(self, outputs: Outputs, errors: Errors) -> tuple[Outputs, Outputs]:
        """Sends the routed requests' rows to their ingresses. Returns what the front relays
        (the rest) and the routed choices' last batches, which only end their `generate`."""
        for rid, _ in errors:
            self._requests.pop(rid, None)
        if not self._requests:
            return outputs, []
        relayed: Outputs = []
        ended: Outputs = []
        rows: dict[str, list[list]] = {}
        for rid, batch in outputs:
            route = self._requests.get(rid)
            if route is None:
                relayed.append((rid, batch))
                continue
            rows.setdefault(route.ingress, []).append(proto.batch_row(rid, batch))
            if batch.finish_reason is not None:
                ended.append((rid, batch))
                route.choices_left -= 1
                if not route.choices_left:
                    del self._requests[rid]
        for ingress, ingress_rows in rows.items():
            self._sockets[ingress].send(proto.encode(ingress_rows))
        return relayed, ended

    def close(self) -> None:
        for ingress in list(self._sockets):
            self.disconnect(ingress)
