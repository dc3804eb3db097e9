"""Metric math on synthetic per-request records: no network, no clocks."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.metrics import (
    Distribution,
    compute_metrics,
    max_concurrency,
    meets_slos,
    parse_goodput,
    parse_percentiles,
)
from benchmarks.records import RequestOutcome


def ok(
    ttft: float, latency: float, out: int, prompt: int = 10, itl: tuple[float, ...] = (), start: float = 0.0
) -> RequestOutcome:
    return RequestOutcome(True, prompt, out, out, ttft=ttft, itl=itl, latency=latency, start_time=start)


def failed(start: float = 0.0) -> RequestOutcome:
    return RequestOutcome(False, 10, 0, 8, latency=0.5, start_time=start, error="HTTP 500")


def test_tpot_is_decode_time_over_tokens_after_first() -> None:
    assert ok(0.1, 1.0, 10).tpot == pytest.approx(0.1)
    assert ok(0.1, 1.0, 1).tpot is None
    assert failed().tpot is None


def test_distribution_matches_numpy_percentiles_in_ms() -> None:
    values = [0.1, 0.2, 0.3, 0.4]
    dist = Distribution.of(values, (50.0, 90.0, 99.0))
    ms = np.array(values) * 1000
    assert dist.count == 4
    assert dist.mean == pytest.approx(250.0)
    assert dist.median == pytest.approx(250.0)
    assert dist.std == pytest.approx(float(ms.std()))
    assert dict(dist.percentiles) == pytest.approx(
        {50.0: 250.0, 90.0: float(np.percentile(ms, 90)), 99.0: float(np.percentile(ms, 99))}
    )


def test_event_gaps_are_summarised_apart_from_the_split_itl() -> None:
    # one chunk of 4 tokens after 0.4 s: ITL says 0.1 s four times, a reader waited 0.4 s once
    grouped = RequestOutcome(True, 10, 5, 5, ttft=0.1, itl=(0.1,) * 4, latency=0.5,
                             event_gaps=(0.4,))
    m = compute_metrics([grouped], duration_s=1.0, percentiles=(50.0,))
    assert m.itl.median == pytest.approx(100.0) and m.event_gap.median == pytest.approx(400.0)
    summary = m.to_summary()
    assert summary["median_event_gap_ms"] == pytest.approx(400.0)
    assert summary["p50_event_gap_ms"] == pytest.approx(400.0)
    assert RequestOutcome.from_dict(grouped.to_dict()) == grouped


def test_empty_distribution_is_zeros() -> None:
    dist = Distribution.of([], (99.0,))
    assert (dist.count, dist.mean, dist.median, dist.percentiles) == (0, 0.0, 0.0, ((99.0, 0.0),))


def test_compute_metrics_counts_throughput_and_excludes_failures() -> None:
    outcomes = [
        ok(0.1, 1.0, 10, prompt=100, itl=(0.1,) * 9),
        ok(0.3, 2.1, 10, prompt=50, itl=(0.2,) * 9),
        ok(0.2, 0.2, 1, prompt=30),  # one token: no TPOT, no ITL
        failed(),
    ]
    m = compute_metrics(outcomes, duration_s=2.0, percentiles=(50.0, 99.0))
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input_tokens == 180
    assert m.total_output_tokens == 21
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(10.5)
    assert m.total_token_throughput == pytest.approx(100.5)
    assert m.ttft.mean == pytest.approx(200.0)
    # TPOT per request: (1.0-0.1)/9 = 100 ms and (2.1-0.3)/9 = 200 ms; the 1-token request is left out.
    assert m.tpot.count == 2
    assert m.tpot.mean == pytest.approx(150.0)
    # ITL pools every gap of every request.
    assert m.itl.count == 18
    assert m.itl.mean == pytest.approx(150.0)
    assert m.e2el.median == pytest.approx(1000.0)
    assert m.request_goodput is None and m.good_requests is None


def test_goodput_counts_requests_within_all_slos() -> None:
    outcomes = [
        ok(0.05, 0.5, 10),  # ttft 50ms, tpot 50ms, e2el 500ms
        ok(0.30, 0.6, 10),  # ttft too slow
        ok(0.05, 2.0, 10),  # tpot ~216ms too slow
        ok(0.05, 0.05, 1),  # single token: tpot counts as 0
        failed(),
    ]
    m = compute_metrics(outcomes, 2.0, goodput_slos={"ttft": 100, "tpot": 60})
    assert m.good_requests == 2
    assert m.request_goodput == pytest.approx(1.0)
    m = compute_metrics(outcomes, 2.0, goodput_slos={"e2el": 550})
    assert m.good_requests == 2  # 500 ms and 50 ms


def test_meets_slos_boundary_is_inclusive() -> None:
    assert meets_slos(ok(0.1, 1.0, 10), {"ttft": 100.0, "e2el": 1000.0})
    assert not meets_slos(failed(), {})


def test_max_concurrency_from_intervals() -> None:
    outcomes = [
        ok(0.1, 1.0, 2, start=0.0),
        ok(0.1, 1.0, 2, start=0.5),
        ok(0.1, 0.2, 2, start=1.0),
        ok(0.1, 1.0, 2, start=3.0),
    ]
    # [0,1) [0.5,1.5) [1.0,1.2) [3,4): at most two overlap (the first ends as the third starts).
    assert max_concurrency(outcomes) == 2


def test_summary_keys_follow_vllm_naming() -> None:
    m = compute_metrics([ok(0.1, 1.0, 10, itl=(0.1,) * 9)], 1.0, percentiles=(90.0, 99.9))
    s = m.to_summary()
    for key in (
        "mean_ttft_ms",
        "median_tpot_ms",
        "p90_itl_ms",
        "p99.9_e2el_ms",
        "output_throughput",
        "request_goodput",
    ):
        assert key in s


def test_zero_duration_is_rejected() -> None:
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)


def test_parse_percentiles() -> None:
    assert parse_percentiles("50, 90,99.9") == (50.0, 90.0, 99.9)
    for bad in ("", "abc", "101", "-1"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:200", "TPOT:50", "e2el:1e3"]) == {"ttft": 200.0, "tpot": 50.0, "e2el": 1000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
