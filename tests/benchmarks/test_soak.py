"""`bench soak`: the request mix it sends and the memory readings it takes."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import psutil

from benchmarks.soak import request_body, rss_mib


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
