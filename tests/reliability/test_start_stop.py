"""Stopping `shardserve serve` (the real command) leaves nothing: over repeated start/stop cycles,
by Ctrl-C (SIGINT to the process group, even started with SIGINT ignored as a shell's background
job), SIGTERM to the whole group and SIGTERM to the process (what systemd, docker and Kubernetes
send), nothing listens on the port afterwards and no process of the run is left (no haproxy, Ray
or replica process), so the next start on the same port works. (The suite runs the cycles only
when asked, see CYCLES; its own stops: SIGTERM to the process below, Ctrl-C to the group in
tests/serve_app/test_cli.py.)
And a stop drains: a request in flight finishes, a new one is refused with 503."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from replicas.status_board import REPORT_PERIOD_S
from tests.conftest import free_port, wait_nothing_left

pytestmark = pytest.mark.slow

# 25-47 s a cycle on 2 cores (Zen 5 / Zen 3): the suite runs none, to stay within its time (its
# two runs of the command stop by SIGTERM to the process, the drain test below, and by Ctrl-C to
# the group, tests/serve_app/test_cli.py, and check the same); SHARDSERVE_START_STOP_CYCLES=20
# gives the count the reliability issue set, each way in turn
CYCLES = int(os.environ.get("SHARDSERVE_START_STOP_CYCLES", "0"))
MODEL = "shardserve/tiny-llama"
SERVE = [os.path.join(os.path.dirname(sys.executable), "shardserve"), "serve", "--model", MODEL,
         "--max-model-len", "1024", "--kv-cache-gib", "0.05", "--max-num-seqs", "4",
         "--num-cpus", "2"]


def _start(port: int, *extra: str) -> subprocess.Popen:
    # started as a shell starts a background job (SIGINT ignored): Ctrl-C must still stop it
    proc = subprocess.Popen([*SERVE, "--port", str(port), *extra], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 120
    for line in proc.stdout:  # type: ignore[union-attr]
        if "shardserve: serving" in line:
            break
        assert time.monotonic() < deadline and proc.poll() is None, line
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
    return proc


def _stop_and_check(proc: subprocess.Popen, port: int, how: str) -> float:
    started = time.monotonic()
    if how == "term":
        proc.send_signal(signal.SIGTERM)
    elif how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    elif how == "group-term":
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    stopped = time.monotonic() - started
    left = wait_nothing_left(proc.pid, port)
    assert not left, (how, left)
    return stopped


def _chat(base: str, **extra) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        **extra})


@pytest.mark.skipif(CYCLES == 0, reason="SHARDSERVE_START_STOP_CYCLES=N runs N cycles")
@pytest.mark.timeout(60 * CYCLES + 120)
def test_start_stop_cycles_leave_nothing() -> None:
    port = free_port()
    ways = ["ctrl-c", "group-term", "term"]
    times = []
    for cycle in range(CYCLES):
        proc = _start(port, "--shutdown-grace-s", "2")
        if cycle % 5 == 0:
            assert _chat(f"http://127.0.0.1:{port}").status_code == 200
        times.append(_stop_and_check(proc, port, ways[cycle % 3]))
        print(f"cycle {cycle} ({ways[cycle % 3]}): stopped in {times[-1]:.1f} s", flush=True)
    print(f"stop times: max {max(times):.1f} s, mean {sum(times) / len(times):.1f} s")


def test_a_stop_drains_in_flight_and_refuses_new_requests() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # 4 x 2,000 tokens: seconds of work even for the tiny model (4 x 1,000 took 10-17 s on an
    # AVX2 Zen 3 box, and ended before the stop was seen on a Xeon with AMX); the prompt and
    # 2,000 tokens fit --max-model-len 2048
    proc = _start(port, "--shutdown-grace-s", "60", "--max-model-len", "2048",
                  "--kv-cache-gib", "0.1")
    result: dict[str, object] = {}

    def stream() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 4,
                "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        result["done"] = lines[-1] == "data: [DONE]"
        result["finished"] = sum('"finish_reason":"length"' in line for line in lines)
    worker = threading.Thread(target=stream)
    worker.start()
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    # the command first spends up to a second telling a signal to it from one to its whole
    # group, then raises the flag; the ingress reads it within a status period. (A chat sent
    # before that is admitted and waits for a slot the n=4 stream holds, so /health, which
    # never queues, is what is polled.)
    deadline = time.monotonic() + 10
    while httpx.get(f"{base}/health", timeout=10).status_code == 200:
        assert time.monotonic() < deadline, "/health never said draining"
        time.sleep(0.1)
    # /health's application and the ingress each pull the board every status period: the
    # ingress may see the flag up to a period (plus a busy loop's lag) after /health did
    time.sleep(3 * REPORT_PERIOD_S)
    assert worker.is_alive(), "the stream ended before the stop was seen: too little work"
    refused = _chat(base)
    assert refused.status_code == 503, refused.text
    assert "shutting down" in refused.json()["error"]["message"]
    worker.join(timeout=120)
    assert result == {"done": True, "finished": 4}
    _stop_and_check(proc, port, "already")
