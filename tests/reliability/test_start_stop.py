"""Stopping `shardserve serve` (the real command) leaves nothing: over repeated start/stop cycles,
by SIGTERM to the process (what systemd, docker and Kubernetes send), Ctrl-C (SIGINT to the
process group) and SIGTERM to the whole group, nothing listens on the port afterwards and no
process of the run is left (no haproxy, Ray or replica process), so the next start on the same
port works.
And a stop drains: a request in flight finishes, a new one is refused with 503."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from replicas.status_board import REPORT_PERIOD_S
from tests.conftest import free_port

pytestmark = pytest.mark.slow

# 25-40 s a cycle on 2 cores (Zen 5 / Zen 3): the suite runs 2 (Ctrl-C, SIGTERM to the group;
# the drain test below stops by SIGTERM to the process and checks the same) to stay within its
# time; SHARDSERVE_START_STOP_CYCLES=20 gives the count the reliability issue set
CYCLES = int(os.environ.get("SHARDSERVE_START_STOP_CYCLES", "2"))
MODEL = "shardserve/tiny-llama"
SERVE = [os.path.join(os.path.dirname(sys.executable), "shardserve"), "serve", "--model", MODEL,
         "--max-model-len", "1024", "--kv-cache-gib", "0.05", "--max-num-seqs", "4",
         "--num-cpus", "2"]


def _start(port: int, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([*SERVE, "--port", str(port), *extra], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    for line in proc.stdout:  # type: ignore[union-attr]
        if "shardserve: serving" in line:
            break
        assert time.monotonic() < deadline and proc.poll() is None, line
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
    return proc


def _run_processes(session: int) -> list[str]:
    """Processes of the run still alive: its session (Ray's processes and haproxy inherit it)
    and the reaper (in a session of its own)."""
    left = []
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


def _listening(port: int) -> bool:
    return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
               for c in psutil.net_connections("tcp"))


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
    deadline = time.monotonic() + 15
    while (_listening(port) or _run_processes(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert not _listening(port), f"{how}: port {port} still listening"
    assert not _run_processes(proc.pid), (how, _run_processes(proc.pid))
    return stopped


def _chat(base: str, **extra) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        **extra})


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
    # 4 x 2,000 tokens: seconds of work even for the tiny model
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
