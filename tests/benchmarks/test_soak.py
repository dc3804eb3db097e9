"""`bench soak`: the request mix it sends (and `bench chaos`), what it makes of each answer, and the
memory readings it takes."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import httpx
import psutil

from benchmarks.soak import attempt, request_body, rss_mib


def test_request_mix_covers_the_per_request_allocations() -> None:
    rng = random.Random(0)
    bodies = [request_body("m", i, rng, 8) for i in range(10)]
    assert {b.get("n") for b in bodies} == {None, 2}
    assert sum(b.get("logprobs", False) for b in bodies) == 2
    assert sum("stop" in b for b in bodies) == 2
    assert sum(b.get("response_format", {}).get("type") == "json_schema" for b in bodies) == 2
    assert all(b["max_tokens"] == 8 and b["temperature"] > 0 for b in bodies)
    # distinct prompts: no two requests share a prefix-cache entry by accident
    assert len({b["messages"][0]["content"] for b in bodies}) == 10


def test_rss_of_live_and_vanished_processes() -> None:
    # the child says when its interpreter is up: read just after spawning, its RSS can still be
    # that of the half-started process
    child = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); "
                              "time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        procs = {"self": psutil.Process(os.getpid()), "child": psutil.Process(child.pid)}
        live = rss_mib(procs)
        assert live["self"] > 10 and live["child"] > 1
    finally:
        child.kill()
        child.wait()
    gone = rss_mib(procs)
    assert gone["self"] > 10 and gone["child"] != gone["child"]  # NaN: the process went away


async def test_each_answer_is_read_as_its_client_saw_it(fake_server) -> None:
    url = fake_server.base_url + "/v1/chat/completions"
    body = {"model": "fake-model", "max_tokens": 3, "fake_delay_s": 0.001,
            "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(timeout=10) as client:
        whole = await attempt(client, url, body, stream=True, disconnect=False)
        left = await attempt(client, url, body, stream=True, disconnect=True)
        refused = await attempt(client, url, body | {"fake_status": 503}, stream=True,
                                disconnect=False)
        broken = await attempt(client, url, body | {"fake_error_after": 1}, stream=True,
                               disconnect=False)
        plain = await attempt(client, url, body | {"fake_status": 500}, stream=False,
                              disconnect=False)
    assert whole.ok and whole.done and whole.end >= whole.start
    assert left.ok and left.disconnected and not left.done
    assert not refused.ok and refused.status == 503 and "fake failure" in refused.error
    assert not broken.ok and broken.status == 200 and "boom midstream" in broken.error
    assert not plain.ok and plain.status == 500
