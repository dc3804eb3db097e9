"""The model deployment autoscales with load: 1 -> 2 replicas under sustained concurrent streams,
back to 1 after the load stops (short delays configured for the test)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.conftest import REPLICAS_APP, shared_app

DEPLOYMENT = "LLMReplica-shardserve_tiny-llama"

pytestmark = pytest.mark.shared_app("replicas")


@pytest.fixture(scope="module")
def base_url() -> str:
    return shared_app(REPLICAS_APP)


def running_replicas() -> int:
    from ray import serve
    status = serve.status().applications["shardserve"].deployments[DEPLOYMENT]
    return status.replica_states.get("RUNNING", 0)


def test_scales_up_under_load_and_back_down(base_url: str) -> None:
    assert running_replicas() == 1
    stop = threading.Event()

    def stream_forever() -> None:
        body = {"model": "shardserve/tiny-llama", "max_tokens": 400, "stream": True,
                "ignore_eos": True, "messages": [{"role": "user", "content": "go"}]}
        while not stop.is_set():
            with httpx.stream("POST", f"{base_url}/chat/completions", json=body,
                              timeout=120) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        break

    threads = [threading.Thread(target=stream_forever, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and running_replicas() < 2:
            time.sleep(0.5)
        assert running_replicas() == 2
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and running_replicas() > 1:
        time.sleep(0.5)
    assert running_replicas() == 1
