"""Shared fixtures: a real Ray Serve app on the embedded model, started once per test module, or
once for the modules marked `shared_app` that ask for the same one."""

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
    # the modules that share an app run last, grouped by it: each app starts once, and no other
    # module runs beside an idle one or starts Ray while it lives
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


@contextlib.contextmanager
def running_app(config_args: dict[str, Any], num_cpus: int = 4,
                http_front: str = "serve-proxy") -> Iterator[str]:
    """Starts Ray, Serve (behind `http_front`: see serve_app/http_front.py) and our app; yields
    the base URL (…/v1); tears all down after."""
    import os

    import ray
    from ray import serve

    from serve_app import http_front as fronts
    from serve_app.app import deploy
    from serve_app.config import AppConfig

    stop_shared_app()  # one Ray instance at a time in this process
    port = free_port()
    config = AppConfig.model_validate({"port": port, **config_args})
    if http_front == "haproxy" and not fronts.haproxy_available():
        pytest.skip("no HAProxy binary here")
    saved = dict(os.environ)
    fronts.select(http_front)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        deploy(config)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        yield f"{base}/v1"
    finally:
        # ray.shutdown() ends every actor of this module's Ray instance (a graceful
        # serve.shutdown() first only adds seconds of draining per module)
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)


_shared: dict[str, Any] = {}  # the live shared app: its key, its ExitStack, its URL


def shared_app(config_args: dict[str, Any], http_front: str = "haproxy") -> str:
    """The base URL (…/v1) of an app kept for the modules that ask for the same one (each marked
    `shared_app`, so they run one after another): started by the first, stopped when another
    app starts or the session ends. On a 2-core box each start is 25-35 s. Behind HAProxy, as
    `shardserve serve` runs it."""
    key = json.dumps([config_args, http_front], sort_keys=True)
    if _shared.get("key") == key:
        return _shared["url"]
    stop_shared_app()
    stack = contextlib.ExitStack()
    url = stack.enter_context(running_app(config_args, http_front=http_front))
    _shared.update(key=key, stack=stack, url=url)
    return url


def stop_shared_app() -> None:
    if _shared:
        stack = _shared["stack"]
        _shared.clear()
        stack.close()


@pytest.fixture(scope="session", autouse=True)
def _shared_app_stops_last() -> Iterator[None]:
    yield
    stop_shared_app()


SMALL_MODEL = {"model": "shardserve/tiny-llama", "max_model_len": 1024, "kv_cache_gib": 0.1,
               "max_num_seqs": 32, "num_threads": 2, "replica_num_cpus": 1.0}
# the apps the `shared_app` modules share: the plain one, and one that trusts request templates
PLAIN_APP = {"models": [{**SMALL_MODEL, "max_num_seqs": 48, "structured_timeout_s": 2.0}]}
TRUSTED_APP = {"models": [SMALL_MODEL], "trust_request_chat_template": True,
               "chat_template_timeout_s": 2.0}
