"""The runner: scheduling, concurrency caps, warmups, and the CLI end to end on the fake server."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.cli import add_bench_parser, main
from benchmarks.datasets import BenchRequest, random_requests
from benchmarks.records import RequestOutcome
from benchmarks.serve import RunSettings, WarmupError, run_benchmark


class FakeSend:
    """An in-process ``send``: sleeps, tracks peak in-flight count, fails on request."""

    def __init__(self, service_s: float = 0.02, fail: bool = False) -> None:
        self.service_s, self.fail = service_s, fail
        self.in_flight = self.peak = self.calls = 0
        self.sent_at: list[float] = []
        self.prompts: list[str] = []

    async def __call__(self, request: BenchRequest) -> RequestOutcome:
        start = time.perf_counter()
        self.calls += 1
        self.sent_at.append(start)
        self.prompts.append(request.prompt)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.service_s)
        self.in_flight -= 1
        if self.fail:
            return RequestOutcome(False, request.prompt_len, 0, request.output_len, start_time=start, error="nope")
        return RequestOutcome(
            True,
            request.prompt_len,
            request.output_len,
            request.output_len,
            ttft=0.005,
            itl=(0.001,) * (request.output_len - 1),
            latency=self.service_s,
            start_time=start,
        )


REQUESTS = random_requests(20, input_len=8, output_len=4, seed=0)


def test_closed_loop_caps_in_flight_requests() -> None:
    send = FakeSend()
    run = asyncio.run(run_benchmark(send, REQUESTS, RunSettings(max_concurrency=3, show_progress=False)))
    assert send.peak == 3
    assert run.metrics.completed == 20 and run.metrics.failed == 0
    assert run.metrics.total_output_tokens == 80
    # 20 requests, 3 at a time, 20 ms each: at least 7 rounds.
    assert run.duration_s >= 0.14
    assert min(o.start_time for o in run.outcomes) >= 0.0  # rebased to the run start


def test_open_loop_follows_the_arrival_schedule() -> None:
    send = FakeSend(service_s=0.001)
    run = asyncio.run(run_benchmark(send, REQUESTS, RunSettings(request_rate=100.0, seed=3, show_progress=False)))
    from benchmarks.arrivals import send_offsets

    expected = send_offsets(20, 100.0, 1.0, 3)
    actual = [t - send.sent_at[0] for t in send.sent_at]
    assert actual == pytest.approx(expected.tolist(), abs=0.05)
    assert run.duration_s >= expected[-1]


def test_unbounded_rate_sends_all_at_once() -> None:
    send = FakeSend()
    asyncio.run(run_benchmark(send, REQUESTS, RunSettings(show_progress=False)))
    assert send.peak == 20


def test_warmups_are_sent_but_not_measured() -> None:
    send = FakeSend()
    run = asyncio.run(run_benchmark(send, REQUESTS[:4], RunSettings(num_warmups=6, show_progress=False)))
    assert send.calls == 10 and len(run.outcomes) == 4


def test_warmups_use_their_own_prompts_when_given() -> None:
    send = FakeSend()
    warmups = random_requests(2, input_len=8, output_len=4, seed=99)
    asyncio.run(run_benchmark(send, REQUESTS[:3], RunSettings(num_warmups=3, show_progress=False), warmups))
    assert send.prompts[:3] == [warmups[0].prompt, warmups[1].prompt, warmups[0].prompt]
    assert send.prompts[3:] == [r.prompt for r in REQUESTS[:3]]


def test_failed_warmup_stops_the_run() -> None:
    with pytest.raises(WarmupError, match="nope"):
        asyncio.run(run_benchmark(FakeSend(fail=True), REQUESTS, RunSettings(num_warmups=1, show_progress=False)))


def test_cli_serve_end_to_end(fake_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = tmp_path / "run.json"
    rc = main(
        [
            "serve",
            "--base-url",
            fake_server.base_url,
            "--num-prompts",
            "8",
            "--random-input-len",
            "16",
            "--random-output-len",
            "4",
            "--ignore-eos",
            "--max-concurrency",
            "4",
            "--num-warmups",
            "1",
            "--goodput",
            "ttft:5000",
            "tpot:5000",
            "--percentiles",
            "50,99",
            "--result-json",
            str(result),
            "--disable-tqdm",
            "--label",
            "c4",
            "--metadata",
            "gpu=none",
            "--extra-body",
            '{"fake_delay_s": 0.002}',
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    for line in (
        "Serving Benchmark Result",
        "Successful requests:",
        "Request goodput (req/s):",
        "P99 TPOT (ms):",
        "Mean ITL (ms):",
    ):
        assert line in printed
    doc = json.loads(result.read_text())
    assert doc["config"]["model"] == "fake-model"  # discovered via /v1/models
    assert doc["config"]["request_rate"] == "inf" and doc["config"]["metadata"] == {"gpu": "none"}
    assert "api_key" not in doc["config"]
    assert doc["summary"]["completed"] == 8 and doc["summary"]["good_requests"] == 8
    assert doc["summary"]["total_output_tokens"] == 32 and "p99_ttft_ms" in doc["summary"]
    assert len(doc["requests"]) == 8
    assert all(len(r["itl"]) == 3 and r["success"] for r in doc["requests"])


def test_cli_reports_failures(fake_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "serve",
            "--base-url",
            fake_server.base_url,
            "--model",
            "m",
            "--num-prompts",
            "3",
            "--random-input-len",
            "4",
            "--random-output-len",
            "2",
            "--disable-tqdm",
            "--extra-body",
            '{"fake_status": 500}',
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "Failed requests:                         3" in out and "HTTP 500" in out


def test_cli_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["serve", "--goodput", "itl:5"],
        ["serve", "--request-rate", "0"],
        ["serve", "--random-range-ratio", "1"],
        ["serve", "--percentiles", "200"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2


def test_add_bench_parser_hangs_under_a_host_cli() -> None:
    import argparse

    host = argparse.ArgumentParser(prog="shardserve")
    add_bench_parser(host.add_subparsers(dest="command"))
    args = host.parse_args(["bench", "serve", "--model", "m", "--request-rate", "2.5", "--max-concurrency", "8"])
    assert args.bench_command == "serve" and args.request_rate == 2.5 and args.max_concurrency == 8
    assert callable(args.func)
    args = host.parse_args(["bench", "plot", "a.json", "b.json", "--out-dir", "x"])
    assert args.result_files == ["a.json", "b.json"] and callable(args.func)
    assert math.isinf(host.parse_args(["bench", "serve"]).request_rate)
