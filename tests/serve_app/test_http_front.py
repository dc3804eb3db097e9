"""The environment that picks Serve's HTTP front (no Ray: the CLI test and test_chat_api run it)."""

from __future__ import annotations

import pytest

from serve_app import http_front


def test_haproxy_env_turns_it_on_and_keeps_the_users_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "7")
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")  # the choice itself is ours
    env = http_front.front_env("haproxy")
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "7"
    # free ports, not HAProxy's fixed defaults, so two servers can share a machine; and outside
    # the ranges where Ray's own processes bind ports while they start
    stats, metrics = int(env["RAY_SERVE_HAPROXY_STATS_PORT"]), \
        int(env["RAY_SERVE_HAPROXY_METRICS_PORT"])
    assert stats != metrics and {stats, metrics}.isdisjoint({8404, 9101})
    assert all(20000 <= p < 30000 for p in (stats, metrics))


def test_serve_proxy_env_turns_direct_ingress_off() -> None:
    assert http_front.front_env("serve-proxy") == {"RAY_SERVE_ENABLE_HA_PROXY": "0",
                                                   "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
