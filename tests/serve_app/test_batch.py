"""`shardserve batch` against one real app: a full run, a SIGKILL mid-run and a resume that sends
only what is missing, and the checks that refuse bad files before sending anything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_app.cli import main
from tests.conftest import PLAIN_APP, SMALL_MODEL, free_port, shared_app

ROOT = Path(__file__).resolve().parents[2]
MODEL = SMALL_MODEL["model"]
N = 200
BAD_ID = "req-137"  # max_tokens < 1: the server answers 400, the line records it


pytestmark = pytest.mark.shared_app("plain")


@pytest.fixture(scope="module")
def server() -> str:
    """The server root (no /v1), as `--base-url` takes it."""
    return shared_app(PLAIN_APP).removesuffix("/v1")


def _request(i: int) -> dict[str, Any]:
    custom_id = f"req-{i:03d}"
    if i % 2:
        url, body = "/v1/completions", {"model": MODEL, "prompt": f"Number {i} is", "max_tokens": 4}
    else:
        url, body = "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 4}
    if custom_id == BAD_ID:
        body["max_tokens"] = -1
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


@pytest.fixture(scope="module")
def batch_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("batch") / "in.jsonl"
    path.write_text("".join(json.dumps(_request(i)) + "\n" for i in range(N)))
    return path


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_complete(out: Path) -> list[dict[str, Any]]:
    lines = _lines(out)
    ids = [rec["custom_id"] for rec in lines]
    assert sorted(ids) == [f"req-{i:03d}" for i in range(N)]  # every one, exactly once
    for rec in lines:
        assert rec["id"].startswith("batch_req_") and rec["error"] is None
        response = rec["response"]
        assert response["request_id"]
        if rec["custom_id"] == BAD_ID:
            assert response["status_code"] == 400
            assert response["body"]["error"]["message"]
            continue
        assert response["status_code"] == 200, rec
        choice = response["body"]["choices"][0]
        is_completion = int(rec["custom_id"][4:]) % 2
        assert isinstance(choice["text"] if is_completion else choice["message"]["content"], str)
        assert response["body"]["usage"]["completion_tokens"] <= 4
    return lines


def _successes(server: str) -> float:
    """Requests the server finished (vllm:request_success), read once nothing is in flight and
    the count holds still (a killed client's last requests may still be finishing)."""
    last, deadline = -1.0, time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(f"{server}/metrics", timeout=10).text
        values: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                values[s.name] = values.get(s.name, 0.0) + s.value
        busy = values.get("vllm:num_requests_running", 0) + values.get(
            "vllm:num_requests_waiting", 0)
        count = values.get("vllm:request_success_total", 0.0)
        if not busy and count == last:
            return count
        last = count
        time.sleep(0.5)
    raise AssertionError("the server did not go idle")


def _batch_cmd(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "serve_app.cli", "batch", "--disable-tqdm", *map(str, args)]


def test_full_run_writes_one_line_per_request(server: str, batch_input: Path,
                                              tmp_path: Path) -> None:
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    code = main(["batch", "--input", str(batch_input), "--output", str(out), "--base-url", server,
                 "--concurrency", "16", "--disable-tqdm", "--stats-json", str(stats)])
    assert code == 0
    _check_complete(out)
    summary = json.loads(stats.read_text())
    assert {k: summary[k] for k in ("total", "done", "skipped", "failed", "errors")} == \
        {"total": N, "done": N, "skipped": 0, "failed": 1, "errors": 0}


def test_killed_run_resumes_sending_only_the_missing(
        server: str, batch_input: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    log = (tmp_path / "killed.log").open("wb")
    proc = subprocess.Popen(_batch_cmd("--input", batch_input, "--output", out,
                                       "--base-url", server, "--concurrency", "2"),
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_bytes().count(b"\n") >= 40):
            assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        log.close()
    written = out.read_bytes().count(b"\n")
    assert 40 <= written < N
    with out.open("ab") as f:  # what a kill in the middle of a write leaves behind
        f.write(b'{"id":"batch_req_torn","custom_id":"req-1')
    before = _successes(server)

    code = main(["batch", "--input", str(batch_input), "--output", str(out), "--base-url",
                 server, "--concurrency", "16", "--disable-tqdm", "--stats-json", str(stats)])
    rerun = capsys.readouterr()
    assert code == 0, rerun.err
    assert "cut a partial last line" in rerun.err
    lines = _check_complete(out)
    summary = json.loads(stats.read_text())
    assert (summary["skipped"], summary["done"]) == (written, N - written)
    assert f"{N - written} done" in rerun.out and f"{written} skipped" in rerun.out
    # the server saw exactly the re-run's requests (the 400 never reaches the engine)
    ok_in_rerun = sum(rec["response"]["status_code"] == 200 for rec in lines[written:])
    assert _successes(server) - before == ok_in_rerun


def test_no_response_is_an_error_line_and_retry_failed_redoes_it(server: str,
                                                                 tmp_path: Path) -> None:
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(_request(i)) + "\n" for i in (1, 2)))
    nobody = f"http://127.0.0.1:{free_port()}"
    args = ["batch", "--input", str(path), "--output", str(out), "--disable-tqdm"]
    assert main([*args, "--base-url", nobody, "--max-retries", "0"]) == 1
    assert [rec["error"]["code"] for rec in _lines(out)] == ["connection_error"] * 2
    # without --retry-failed those lines count as done
    assert main([*args, "--base-url", server]) == 0 and len(_lines(out)) == 2
    assert main([*args, "--base-url", server, "--retry-failed"]) == 0
    lines = _lines(out)
    assert sorted(r["custom_id"] for r in lines) == ["req-001", "req-002"]
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in lines)


def test_bad_files_are_refused_before_sending(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"  # anything sent would fail loudly
    good = json.dumps(_request(0))
    cases = {
        "duplicate custom_id": [good, json.dumps(_request(1)), good],
        "`url` must be one of": [json.dumps({**_request(0), "url": "/v1/embeddings"})],
        "not valid JSON": ["{nope"],
        "is not supported in a batch": [json.dumps(
            {**_request(0), "body": {**_request(0)["body"], "stream": True}})],
    }
    for message, lines in cases.items():
        path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        path.write_text("\n".join(lines) + "\n")
        assert main(["batch", "--input", str(path), "--output", str(out),
                     "--base-url", nobody]) == 2
        assert message in capsys.readouterr().err and not out.exists()
    # an unreadable line before good ones is not a torn write: refuse to append
    path.write_text(good + "\n")
    out.write_text('{"custom_id": "x", "response": null, "error": null}\ngarbage\n'
                   '{"custom_id": "y", "response": null, "error": null}\n')
    assert main(["batch", "--input", str(path), "--output", str(out), "--base-url", nobody]) == 2
    assert "refusing to append" in capsys.readouterr().err
    assert os.path.getsize(out) > 0
