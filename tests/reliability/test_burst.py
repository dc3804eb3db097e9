"""A burst far beyond capacity: every answer is 200, 429 or 503 with the OpenAI envelope and
comes within the queue-wait deadline plus 2 s; /health answers in under a second throughout;
the memory of the replica, its engine core and the ingress comes back; the server serves normally afterwards."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import httpx
import psutil
import pytest

from benchmarks.burst import run_burst
from tests.conftest import SMALL_MODEL, shared_app

pytestmark = [pytest.mark.shared_app("burst"), pytest.mark.slow]

MODEL = "shardserve/tiny-llama"
# the bound under test is this deadline + 3 s; shedding 1,000 connections takes the ingress 2-4 s
# of one core's CPU (Serve's per-request work), on 2 cores shared with the engine and this
# test's own client: on an AVX2-only Zen 3 box the last refusal of the first burst came after
# 3.4-4.0 s with the ingress at the core's niceness while it sheds, 5.3-9.2 s at Ray's 15
DEADLINE_S = 5.0
BURST = 1000
CONFIG = {"models": [{**SMALL_MODEL, "max_num_seqs": 4, "max_waiting": 8}],
          "max_queue_wait_s": DEADLINE_S}


@pytest.fixture(scope="module")
def base_url() -> str:
    return shared_app(CONFIG, http_front="haproxy")


def _serve_processes() -> dict[str, psutil.Process]:
    """The ingress, model replica and engine core processes (Ray names replicas after their
    deployment; the core names itself)."""
    found = {}
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "ServeReplica:shardserve:Ingress" in cmd:
            found["ingress"] = p
        elif "ServeReplica:shardserve:LLMReplica" in cmd:
            found["replica"] = p
        elif "shardserve::EngineCore" in cmd:
            found["core"] = p
    return found


def _chat() -> dict:
    return {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}


def test_burst_is_shed_within_the_deadline(base_url: str) -> None:
    procs = _serve_processes()
    assert set(procs) == {"ingress", "replica", "core"}
    # serving, the ingress stays at Ray's 15, behind the core's 5 (replicas/niceness.py; where
    # lowering a niceness is not permitted both stay at 15)
    renices = os.geteuid() == 0
    assert procs["ingress"].nice() == 15 and procs["core"].nice() == (5 if renices else 15)
    warm_s = []
    for _ in range(20):  # warm: the first requests build caches and import paths
        started = time.monotonic()
        assert httpx.post(f"{base_url}/chat/completions", json=_chat(), timeout=60).is_success
        warm_s.append(time.monotonic() - started)
    rss_before = {k: p.memory_info().rss for k, p in procs.items()}

    # shedding, it takes the core's: else it sheds in what the busy core leaves of the cores
    niceness: set[int] = set()
    bursting = threading.Event()

    def watch() -> None:
        while not bursting.wait(0.05):
            niceness.add(procs["ingress"].nice())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = asyncio.run(run_burst(base_url, BURST, MODEL))
    finally:
        bursting.set()
        watcher.join()
    assert (5 in niceness) == renices, niceness

    counts = result.counts
    assert set(counts) <= {200, 429, 503}, counts
    assert counts.get(200, 0) >= 4 and counts.get(503, 0) > 0, counts
    for a in result.answers:
        if a.status == 200:
            assert a.body["choices"][0]["finish_reason"] in ("length", "stop")
        else:
            assert set(a.body["error"]) == {"message", "type", "param", "code"}
            assert a.body["error"]["code"] == a.status and "overloaded" in a.body["error"]["message"]
            assert a.retry_after is not None and int(a.retry_after) >= 1
    summary = result.summary()
    # a refusal's wait is bounded by the deadline; an admitted request's answer also holds its
    # 16 tokens, made while the burst's connections take the same 2 cores (on an AVX2-only box
    # the 200s took up to 5.2 s here): it may take 4x its unloaded time more
    refused = [a.seconds for a in result.answers if a.status != 200]
    served = [a.seconds for a in result.answers if a.status == 200]
    # (the deadline counts from the ingress's admission, and reaching it through the burst's
    # connections takes seconds more: a queued request's 503 came 7.08 s after it was sent once
    # in a clean-clone suite on an AVX2 Zen 3 box, the immediate refusals after ~1.9 s)
    assert max(refused) < DEADLINE_S + 3, summary
    assert max(served) < DEADLINE_S + 2 + 4 * max(warm_s[5:]), (summary, max(warm_s[5:]))
    assert result.health_failures == 0 and summary["health_worst_s"] < 1.0, summary

    # nothing held: the admitted count is back to zero, the refusals are counted
    metrics = httpx.get(f"{base_url.removesuffix('/v1')}/metrics", timeout=10).text
    assert f'shardserve:ingress_requests_in_flight{{model_name="{MODEL}"}} 0.0' in metrics
    assert f'shardserve:requests_rejected_total{{model_name="{MODEL}",reason="overloaded"}}' \
        in metrics
    time.sleep(2.5)
    assert procs["ingress"].nice() == 15  # 2 s after the last refusal
    rss_after = {k: p.memory_info().rss for k, p in procs.items()}
    for k in procs:
        assert rss_after[k] <= rss_before[k] * 1.05, (k, rss_before[k], rss_after[k])
    r = httpx.post(f"{base_url}/chat/completions", json=_chat(), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    print(f"burst of {BURST}: {summary}")
