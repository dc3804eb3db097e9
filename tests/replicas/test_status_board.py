"""The status board's health verdict and the reader's freshness rule (no Ray)."""

from __future__ import annotations

import time

from replicas.status_board import STALE_AFTER_S, BoardReader, unhealthy_reason

OK = {"failed": None, "loop_alive": True, "stalled": False}


def test_one_healthy_replica_is_enough() -> None:
    assert unhealthy_reason("m", [OK]) is None
    assert unhealthy_reason("m", [{**OK, "failed": "shard died"}, OK]) is None


def test_every_way_a_model_cannot_serve_is_named() -> None:
    assert "no replica of m has reported" in unhealthy_reason("m", [])
    assert "shard died" in unhealthy_reason("m", [{**OK, "failed": "shard died"}])
    assert "not running" in unhealthy_reason("m", [{**OK, "loop_alive": False}])
    assert "wedged" in unhealthy_reason("m", [{**OK, "stalled": True}])


def test_reader_serves_only_fresh_reports() -> None:
    reader = BoardReader("app")
    now = time.time()
    reader.snapshot = {"m": {"r1": (now, {"n": 1}), "r2": (now - 2 * STALE_AFTER_S, {"n": 2})}}
    assert reader.fresh("m") == []  # the board itself was never read
    reader.read_at = now
    assert reader.fresh("m") == [{"n": 1}] and reader.fresh("other") == []
    reader.read_at = now - 2 * STALE_AFTER_S  # the ingress lost the board: nothing is fresh
    assert reader.fresh("m") == []


def test_health_needs_a_running_ingress_and_a_healthy_replica_of_each_of_its_models() -> None:
    from replicas.status_board import INGRESS_STALE_AFTER_S
    reader = BoardReader("app")
    now = time.time()
    assert "not been read" in reader.why_unhealthy()
    reader.read_at = now
    assert "no ingress has run" in reader.why_unhealthy()  # before any ingress started
    reader.ingresses = {"i1": (now, ("a", "b"))}
    reader.snapshot = {"a": {"r": (now, OK)}}
    assert "no replica of b" in reader.why_unhealthy()
    reader.snapshot["b"] = {"r": (now, {**OK, "stalled": True})}
    assert "wedged" in reader.why_unhealthy()
    reader.snapshot["b"] = {"r": (now, OK)}
    assert reader.why_unhealthy() is None
    # an ingress whose loop stopped reading: its heartbeat goes stale
    reader.ingresses = {"i1": (now - INGRESS_STALE_AFTER_S - 1, ("a", "b"))}
    assert "no ingress has run" in reader.why_unhealthy()
    reader.ingresses = {"i1": (now, ("a",))}
    reader.draining = True
    assert reader.why_unhealthy() == "the server is shutting down"


class _Method:
    def __init__(self, fn) -> None:  # noqa: ANN001
        self.remote = fn


class _SlowBoard:
    """A board whose reads time out (its process busy) and that takes stop messages."""

    def __init__(self) -> None:
        self.stops: list[tuple] = []
        self.read = _Method(self._read)
        self.stop_choice = _Method(lambda *args: self.stops.append(args))

    async def _read(self, *args: object) -> None:
        raise TimeoutError


async def test_a_failed_read_leaves_stop_messages_a_board_to_go_to(monkeypatch) -> None:  # noqa: ANN001
    """A read that times out under load is retried; a stop string found meanwhile still reaches
    the replica (otherwise the ingress cancels the call, and the tokens generated past the stop
    stay in the counters)."""
    import asyncio
    import contextlib

    from replicas import status_board

    board = _SlowBoard()
    monkeypatch.setattr(status_board, "get_board", lambda app: board)
    reader = BoardReader("app")
    assert not reader.stop_choice("replica-a", "r1", 0, 3)  # never found yet
    reader.start()
    await asyncio.sleep(0.05)  # the first read has failed
    assert reader.read_at == 0.0
    assert reader.stop_choice("replica-a", "r1", 0, 3)
    assert board.stops == [("replica-a", "r1", 0, 3)]
    reader._task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reader._task
