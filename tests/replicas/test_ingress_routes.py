"""The engine core's direct channels (replicas/ingress_routes.py), without a model: which rows go
to an ingress's socket, which to the front, and when a request is forgotten."""

from __future__ import annotations

import zmq

from replicas import core_protocol as proto
from replicas.ingress_routes import IngressRoutes
from replicas.request import EngineError, GenerateRequest, SamplingParams, TokenBatch


def _req(rid: str, ingress: str | None, n: int = 1) -> GenerateRequest:
    return GenerateRequest(rid, (1, 2), SamplingParams(max_tokens=4), n=n, ingress=ingress)


def _b(token: int, finish: str | None = None, choice: int = 0) -> TokenBatch:
    return TokenBatch(choice, (token,), finish_reason=finish)


def test_routed_rows_go_to_their_ingress_and_last_batches_to_the_front_too(tmp_path) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{tmp_path}/in")
    routes = IngressRoutes(ctx)
    try:
        routes.connect("ing", f"ipc://{tmp_path}/in")
        routes.add(_req("a", "ing", n=2))
        routes.add(_req("b", None))  # no direct channel: the front relays it
        routes.add(_req("c", "elsewhere"))  # an ingress without a socket here: the same
        relayed, ended = routes.split(
            [("a", _b(1)), ("b", _b(2)), ("c", _b(3)), ("a", _b(4, choice=1))], [])
        assert [rid for rid, _ in relayed] == ["b", "c"] and ended == []
        assert pull.poll(2000)
        assert [(r[0], r[1], r[2]) for r in proto.decode(pull.recv())] == [
            ("a", 0, [1]), ("a", 1, [4])]
        # a's first choice ends: its row goes to the ingress, its end to the front as well
        relayed, ended = routes.split([("a", _b(5, "stop"))], [])
        assert relayed == [] and [rid for rid, _ in ended] == ["a"]
        assert pull.poll(2000) and proto.decode(pull.recv())[0][3] == "stop"
        # its second choice ends: a is forgotten
        routes.split([("a", _b(6, "length", choice=1))], [])
        assert pull.poll(2000)
        pull.recv()
        assert routes.split([("a", _b(7))], []) == ([("a", _b(7))], [])
        # a failed or aborted request is forgotten; so is every request of a closed channel
        routes.add(_req("d", "ing"))
        routes.add(_req("e", "ing"))
        routes.add(_req("f", "ing"))
        routes.split([], [("d", EngineError("x"))])
        routes.forget("e")
        assert routes.split([("d", _b(1)), ("e", _b(1))], [])[0] == [("d", _b(1)), ("e", _b(1))]
        routes.disconnect("ing")
        assert routes.split([("f", _b(1))], [])[0] == [("f", _b(1))]
        routes.add(_req("g", "ing"))  # after the close: not routed
        assert routes.split([("g", _b(1))], [])[0] == [("g", _b(1))]
    finally:
        routes.close()
        pull.close(linger=0)
        ctx.term()
