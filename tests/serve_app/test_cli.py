"""`shardserve serve` as a user runs it (the default model: SmolLM2-135M-Instruct's GGUF): its own
Ray, HAProxy in front, ready when it says so,
gone (HAProxy included) after SIGINT, even started as a shell starts a background job (SIGINT
ignored); SIGTERM goes to the same handler."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from openai import OpenAI

from replicas.embedded import DEFAULT_MODEL_ID
from serve_app import http_front
from tests.conftest import free_port


def _haproxies() -> set[int]:
    return {p.pid for p in psutil.process_iter(["name"])
            if p.info["name"] == "haproxy" and p.status() != psutil.STATUS_ZOMBIE}


@pytest.mark.skipif(not http_front.haproxy_available(), reason="no HAProxy binary here")
def test_serve_behind_haproxy_answers_then_stops_cleanly() -> None:
    port = free_port()
    before = _haproxies()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve_app.cli", "serve", "--port", str(port), "--num-cpus", "4",
         "--kv-cache-gib", "0.05", "--max-model-len", "512", "--num-threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 120
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("shardserve: serving") or time.monotonic() > deadline:
                break
        assert lines and lines[-1].startswith("shardserve: serving"), "".join(lines[-20:])
        # keep reading its logs, or a full pipe would stall the server
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        front = _haproxies() - before
        assert front, "no HAProxy process in front of the server"
        # "serving" means a request succeeds now, with no retry
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=DEFAULT_MODEL_ID, messages=[{"role": "user", "content": "hi"}],
            max_tokens=5, stream=True, extra_body={"ignore_eos": True})
        chunks = [c for c in stream if c.choices and c.choices[0].delta.content]
        assert 1 <= len(chunks) <= 5
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0
    deadline = time.monotonic() + 10
    while _haproxies() & front and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _haproxies() & front, "HAProxy outlived the server"
