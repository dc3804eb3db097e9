"""`shardserve serve` as `make serve` runs it (the default model, SmolLM2-135M-Instruct's GGUF, and
beside it the tiny LLaVA): its own Ray, HAProxy in front, ready when it says so, an image request
answered, even where a dead cluster's address is left in /tmp/ray/ray_current_cluster (a killed
`ray start` or test: `ray.init()` alone would try to join it); after Ctrl-C (SIGINT to its
process group), even started as a shell starts a background job (SIGINT ignored), it exits 0
and nothing of it is left (HAProxy, Ray's processes, the port). The other ways to stop it:
tests/reliability/test_start_stop.py."""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from openai import OpenAI
from PIL import Image

from replicas.embedded import DEFAULT_MODEL_ID, TINY_LLAVA_MODEL_ID
from serve_app import http_front
from tests.conftest import free_port, left_behind, wait_nothing_left


@contextmanager
def _stale_cluster_address() -> Iterator[None]:
    """Ray's record of the last `ray start`, naming a cluster that is gone."""
    record = Path("/tmp/ray/ray_current_cluster")
    if record.exists():  # a real one: leave it be
        yield
        return
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text("127.0.0.1:9")
    try:
        yield
    finally:
        record.unlink(missing_ok=True)


@pytest.mark.skipif(not http_front.haproxy_available(), reason="no HAProxy binary here")
def test_serve_behind_haproxy_answers_then_stops_cleanly() -> None:
    with _stale_cluster_address():
        _serve_answer_and_stop()


def _serve_answer_and_stop() -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve_app.cli", "serve", "--port", str(port), "--num-cpus", "4",
         "--kv-cache-gib", "0.05", "--max-model-len", "512", "--num-threads", "1",
         "--also-serve", TINY_LLAVA_MODEL_ID],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
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
        front = [line for line in left_behind(proc.pid, port) if "haproxy" in line]
        assert front, "no HAProxy process in front of the server"
        # "serving" means a request succeeds now, with no retry
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=DEFAULT_MODEL_ID, messages=[{"role": "user", "content": "hi"}],
            max_tokens=5, stream=True, extra_body={"ignore_eos": True})
        chunks = [c for c in stream if c.choices and c.choices[0].delta.content]
        assert 1 <= len(chunks) <= 5
        image = io.BytesIO()
        Image.new("RGB", (40, 30), (250, 120, 0)).save(image, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(image.getvalue()).decode()
        r = client.chat.completions.create(model=TINY_LLAVA_MODEL_ID, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}])
        assert r.usage.prompt_tokens > 16 and r.usage.completion_tokens >= 1
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0
    left = wait_nothing_left(proc.pid, port)
    assert not left, left
