"""Shared fixtures: a real Ray Serve app on the embedded model, started once per test module."""

from __future__ import annotations

import contextlib
import random
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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


SMALL_MODEL = {"model": "shardserve/tiny-llama", "max_model_len": 1024, "kv_cache_gib": 0.1,
               "max_num_seqs": 32, "num_threads": 2, "replica_num_cpus": 1.0}
