"""Shared fixtures: real Ray Serve apps on the embedded models, on one Ray instance and Serve
kept for the session, each deployed once for the modules marked `shared_app` that ask for it."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the modules that deploy an app run last, grouped by it: each app is deployed once, and no
    # other module runs beside an idle Ray or starts Ray (or `shardserve serve`) while it lives
    def group(item: pytest.Item) -> str:
        marker = item.get_closest_marker("shared_app")
        return "" if marker is None else marker.args[0]
    items.sort(key=group)  # stable: each module keeps its order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def free_port() -> int:
    """A free port between Serve's direct-ingress ports (30000-31000) and Linux's ephemeral range
    (32768+), at random: none of Ray's processes, HAProxy's own ports (serve_app/http_front.py:
    20000-29999) or outgoing connections take one from there. A port the kernel hands out for
    bind(0) is free only until an outgoing connection takes it, which a Serve proxy then failed
    to bind (CI)."""
    rng = random.Random()
    while True:
        port = rng.randrange(31001, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def left_behind(session: int, port: int) -> list[str]:
    """What a stopped `shardserve serve` started with `start_new_session` (its pid is `session`)
    left: a listener on `port`, a live process of its session (Ray's processes and HAProxy
    inherit it) or Ray's reaper (in a session of its own)."""
    import os

    import psutil

    left = [f"port {port} listening" for c in psutil.net_connections("tcp")
            if c.laddr.port == port and c.status == psutil.CONN_LISTEN]
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            if os.getsid(p.pid) == session or "reaper_main" in cmd:
                left.append(f"{p.pid} {cmd[:80]}")
        except (psutil.Error, ProcessLookupError):
            pass
    return left


def wait_nothing_left(session: int, port: int, within_s: float = 15.0) -> list[str]:
    """`left_behind` once it is empty, or as it stands after `within_s`."""
    deadline = time.monotonic() + within_s
    while (left := left_behind(session, port)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


_cluster: dict[str, Any] = {}  # the live Ray instance with Serve: its key, port, saved env
_shared: dict[str, Any] = {}  # the app deployed on it: its key and URL


def _serve_running(num_cpus: int, http_front: str) -> int:
    """Ray and Serve (behind `http_front`: see serve_app/http_front.py), started once and kept
    while the apps asked for want the same: each start costs ~10 s (`ray.init` ~5, `serve.start`
    ~5) on a 2-core box. Returns Serve's port."""
    import os

    import ray
    from ray import serve

    from serve_app import http_front as fronts
    from serve_app.app import set_serve_env

    key = [num_cpus, http_front]
    if _cluster.get("key") == key:
        return _cluster["port"]
    stop_shared_app()
    if http_front == "haproxy" and not fronts.haproxy_available():
        pytest.skip("no HAProxy binary here")
    port = free_port()
    saved = dict(os.environ)
    fronts.select(http_front)
    set_serve_env()  # as `shardserve serve` starts it
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    _cluster.update(key=key, port=port, env=saved)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def shared_app(config_args: dict[str, Any], http_front: str | None = None,
               num_cpus: int = 4) -> str:
    """The base URL (…/v1) of our app with `config_args`, on the test session's Ray and Serve
    (behind HAProxy, as `shardserve serve` runs it, where there is one). The app stays until a
    module asks for another (then it is deleted and the new one deployed on the same Serve: ~16
    s instead of ~25 for a new Ray instance) or the session ends; the modules that call this
    are marked `shared_app` and run last, grouped by the marker's name, so an app shared by
    modules starts once and no other module runs beside an idle Ray."""
    from serve_app import http_front as fronts
    from serve_app.app import deploy, undeploy
    from serve_app.config import AppConfig

    http_front = http_front or ("haproxy" if fronts.haproxy_available() else "serve-proxy")
    key = json.dumps([config_args, http_front, num_cpus], sort_keys=True)
    if _shared.get("key") == key:
        return _shared["url"]
    if _shared:
        _shared.clear()
        undeploy()
    port = _serve_running(num_cpus, http_front)
    deploy(AppConfig.model_validate({"port": port, **config_args}))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                break
        time.sleep(0.25)
    _shared.update(key=key, url=f"{base}/v1")
    return _shared["url"]


def stop_shared_app() -> None:
    """Ends the session's Ray instance and every actor of it (a graceful serve.shutdown() first
    only adds seconds of draining)."""
    import os

    import ray

    _shared.clear()
    if _cluster:
        saved = _cluster["env"]
        _cluster.clear()
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session", autouse=True)
def _shared_app_stops_last() -> Iterator[None]:
    yield
    stop_shared_app()


SMALL_MODEL = {"model": "shardserve/tiny-llama", "max_model_len": 1024, "kv_cache_gib": 0.1,
               "max_num_seqs": 32, "num_threads": 2, "replica_num_cpus": 1.0}
# the app most `shared_app` modules share; it trusts request templates too (one deploy fewer:
# the refusal of a request's template by a server that does not is checked on the default
# model's app, tests/serve_app/test_default_model.py)
PLAIN_APP = {"models": [{**SMALL_MODEL, "max_num_seqs": 48, "structured_timeout_s": 2.0}],
             "trust_request_chat_template": True, "chat_template_timeout_s": 2.0}
# the app of the replica-count modules: one model that autoscales (1-2 replicas) and one of two
# replicas routed by prefix (tests/serve_app/test_autoscaling.py, test_routing.py)
AUTOSCALED_MODEL = {**SMALL_MODEL, "num_threads": 1, "replica_num_cpus": 0.5,
                    "autoscaling_config": {"min_replicas": 1, "max_replicas": 2,
                                           "target_ongoing_requests": 2, "upscale_delay_s": 0.5,
                                           "downscale_delay_s": 2, "metrics_interval_s": 0.5,
                                           "look_back_period_s": 1}}
ROUTED_MODEL = {**SMALL_MODEL, "served_model_name": "routed-tiny-llama", "num_replicas": 2,
                "num_threads": 1, "replica_num_cpus": 0.5}
REPLICAS_APP = {"models": [AUTOSCALED_MODEL, ROUTED_MODEL]}
