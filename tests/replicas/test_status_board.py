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
