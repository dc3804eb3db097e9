"""One load split over client processes: the shares, and a run against the fake server."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from benchmarks.client import ClientConfig
from benchmarks.client_processes import auto_num_clients, split
from benchmarks.datasets import random_requests
from benchmarks.serve import RunSettings, run_load


def test_split_deals_every_request_once_and_divides_cap_and_rate() -> None:
    shares = split(10, max_concurrency=5, request_rate=6.0, seed=7, num_clients=3)
    assert sorted(i for s in shares for i in s.indices) == list(range(10))
    assert [s.max_concurrency for s in shares] == [2, 2, 1]
    assert all(s.request_rate == 2.0 for s in shares)
    assert len({s.seed for s in shares}) == 3
    # never more processes than streams in flight or requests
    assert len(split(10, 2, math.inf, 0, 8)) == 2
    assert len(split(3, None, math.inf, 0, 8)) == 3
    assert split(4, None, math.inf, 0, 2)[0].max_concurrency is None


def test_auto_num_clients_adds_a_process_per_64_streams_within_half_the_cores() -> None:
    assert auto_num_clients(32, 64, cpu_count=2) == 1
    assert auto_num_clients(256, 768, cpu_count=16) == 4
    assert auto_num_clients(65, 768, cpu_count=16) == 2
    assert auto_num_clients(1024, 4096, cpu_count=16) == 8
    assert auto_num_clients(1024, 4096, cpu_count=4) == 2
    assert auto_num_clients(None, 300, cpu_count=16) == 5  # open loop: every request may be in flight


def test_run_load_over_three_processes_keeps_request_order_and_the_cap(fake_server: Any) -> None:
    requests = random_requests(12, input_len=8, output_len=6, seed=3, range_ratio=0.5)
    assert len({r.output_len for r in requests}) > 1
    config = ClientConfig(base_url=fake_server.base_url, model="fake-model", ignore_eos=True,
                          extra_body={"fake_delay_s": 0.02})
    fake_server.load.peak = 0
    run = asyncio.run(run_load(config, requests, RunSettings(max_concurrency=4, num_warmups=2,
                                                             show_progress=False),
                               num_clients=3))
    assert run.metrics.completed == 12 and run.metrics.failed == 0
    # outcomes come back in request order, whichever process sent them
    assert [o.output_tokens for o in run.outcomes] == [r.output_len for r in requests]
    assert 2 <= fake_server.load.peak <= 4
    assert all(0 <= o.start_time < run.duration_s for o in run.outcomes)
    assert run.metrics.total_output_tokens == sum(r.output_len for r in requests)
