"""A per-request chat template is a program: with --trust-request-chat-template, one that would
loop 10^10 times is a 400 within its time limit while 8 other streams keep producing tokens and
/health keeps answering (without the flag it is refused outright: tests/serve_app)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.conftest import SMALL_MODEL, running_app

pytestmark = pytest.mark.slow

MODEL = "shardserve/tiny-llama"
LIMIT_S = 2.0
LOOP_1E10 = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
             "never")
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def base_url() -> str:
    with running_app({"models": [SMALL_MODEL], "trust_request_chat_template": True,
                      "chat_template_timeout_s": LIMIT_S}) as url:
        yield url


def test_a_runaway_template_stalls_nobody(base_url: str) -> None:
    root = base_url.removesuffix("/v1")
    # the sandbox's worker processes start on first use: not what is timed here
    warm = httpx.post(f"{base_url}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 2, "chat_template": "{{ 'hi' }}"})
    assert warm.status_code == 200, warm.text

    progress = [0] * 8
    stop = threading.Event()

    def stream(i: int) -> None:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 900, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{base_url}/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    progress[i] += 1
                if stop.is_set():
                    break

    health_times: list[float] = []

    def health() -> None:
        while not stop.is_set():
            started = time.monotonic()
            assert httpx.get(f"{root}/health", timeout=10).status_code == 200
            health_times.append(time.monotonic() - started)
            time.sleep(0.1)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(8)]
    threads.append(threading.Thread(target=health, daemon=True))
    for t in threads:
        t.start()
    time.sleep(1.0)
    before = list(progress)
    started = time.monotonic()
    r = httpx.post(f"{base_url}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 5, "chat_template": LOOP_1E10})
    elapsed = time.monotonic() - started
    during = [p - b for p, b in zip(progress, before)]
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template" and "longer than 2 s" in error["message"]
    assert elapsed < LIMIT_S + 1.5
    assert all(d >= 2 for d in during), during  # every stream went on meanwhile
    assert health_times and max(health_times) < 1.0, max(health_times)
