"""The engine core under supervision, through the real Serve app and the openai client: killed
with SIGKILL mid-stream or hung in a step, every stream it held ends with an error event within
5 s, /health turns red, and a new core serves the next requests."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest

from tests.conftest import SMALL_MODEL, shared_app

pytestmark = [pytest.mark.shared_app("engine-core"), pytest.mark.slow]

HANGS = "tests.replicas.processors:Hangs"
STEP_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def base_url() -> str:
    return shared_app({"models": [{**SMALL_MODEL, "step_timeout_s": STEP_TIMEOUT_S,
                                   "health_check_period_s": 2}],
                       "logits_processors": [HANGS]})


def _cores() -> list[psutil.Process]:
    """Live engine cores (a core of an earlier module's app may still be on its way out)."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if ("shardserve::EngineCore" in " ".join(p.info["cmdline"] or ())
                and p.info["status"] != psutil.STATUS_ZOMBIE):
            out.append(p)
    return out


def _one_core() -> psutil.Process:
    deadline = time.monotonic() + 30
    while len(cores := _cores()) != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(cores) == 1, cores
    return cores[0]


def _stream(client: openai.OpenAI, results: list, i: int, **extra: object) -> None:
    """One stream of many tokens: records ("done", tokens) or ("error", seconds after its
    last chunk, message)."""
    tokens, last = 0, time.monotonic()
    try:
        for chunk in client.chat.completions.create(
                model="shardserve/tiny-llama", messages=[{"role": "user", "content": f"go {i}"}],
                max_tokens=900, stream=True, extra_body={"ignore_eos": True, **extra}):
            if chunk.choices and chunk.choices[0].delta.content:
                tokens += 1
                last = time.monotonic()
        results.append(("done", tokens))
    except openai.APIError as exc:
        results.append(("error", time.monotonic(), last, str(exc)))


def _health_codes(base: str, until: float, seen: list[int]) -> None:
    while time.monotonic() < until:
        try:
            seen.append(httpx.get(f"{base}/health", timeout=2).status_code)
        except httpx.HTTPError:
            seen.append(0)
        time.sleep(0.1)


def _recovers(client: openai.OpenAI, within_s: float = 60.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        try:
            r = client.chat.completions.create(
                model="shardserve/tiny-llama", messages=[{"role": "user", "content": "again"}],
                max_tokens=4)
            assert r.choices[0].finish_reason in ("stop", "length")
            return time.monotonic() - start
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc
            time.sleep(0.5)
    raise AssertionError(f"no request succeeded within {within_s} s")


def _check_failover(base_url: str, trigger, n_streams: int = 4) -> None:
    base = base_url.removesuffix("/v1")
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)
    old = _one_core()
    results: list = []
    threads = [threading.Thread(target=_stream, args=(client, results, i))
               for i in range(n_streams)]
    for t in threads:
        t.start()
    time.sleep(1.5)  # the streams are producing tokens
    triggered = trigger(client, old)
    for t in threads:
        t.join(timeout=30)
    assert len(results) == n_streams
    for r in results:
        assert r[0] == "error", r  # none finished its 900 tokens
        assert "restarting" in r[3] or "engine" in r[3], r
        assert r[1] - triggered < 5.0 + STEP_TIMEOUT_S, r  # ended within 5 s of the failure
    took = _recovers(client)
    assert took < 60
    new = _one_core()
    assert new.pid != old.pid and not old.is_running()
    healthy: list[int] = []  # (the board's report is up to 0.5 s old)
    _health_codes(base, time.monotonic() + 3, healthy)
    assert healthy[-1] == 200, healthy


def test_a_killed_core_fails_its_streams_and_a_new_one_serves(base_url: str) -> None:
    base = base_url.removesuffix("/v1")
    seen: list[int] = []

    def kill(client: openai.OpenAI, core: psutil.Process) -> float:
        watcher = threading.Thread(target=_health_codes,
                                   args=(base, time.monotonic() + 4, seen))
        watcher.start()
        os.kill(core.pid, signal.SIGKILL)
        killed = time.monotonic()
        watcher.join()
        return killed

    _check_failover(base_url, kill)
    assert 503 in seen, seen  # /health said so while the new core loaded


def test_a_hung_step_trips_the_watchdog(base_url: str) -> None:
    def hang(client: openai.OpenAI, core: psutil.Process) -> float:
        result: list = []
        threading.Thread(target=_stream, args=(client, result, 99),
                         kwargs={"logits_processors": [{"qualname": HANGS,
                                                        "kwargs": {"after": 2}}]},
                         daemon=True).start()
        return time.monotonic()

    _check_failover(base_url, hang)


def test_the_core_is_named_and_a_child_of_its_replica(base_url: str) -> None:
    core = _one_core()
    parent = core.parent()
    assert parent is not None and "LLMReplica" in " ".join(parent.cmdline())
