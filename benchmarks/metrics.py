"""Pure summary math over ``RequestOutcome``s: throughput, latency distributions, goodput.

No I/O and no clocks, so everything here is unit-testable on synthetic records. Latencies in the
summary are milliseconds, like ``vllm bench serve``; records hold seconds."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.records import RequestOutcome

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "event_gap", "e2el")
METRIC_TITLES: Mapping[str, str] = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    # ITL splits a chunk of k tokens into k equal parts; this is each chunk's own gap, what a
    # reader of the stream waits (vllm bench serve's ITL, where every token is its own chunk)
    "event_gap": "Gap between Streamed Events",
    "e2el": "End-to-end Latency",
}
# Metrics a goodput SLO may constrain (ITL is per token, not per request, so it is not one).
SLO_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency metric in milliseconds; all zeros when ``count`` is 0."""

    count: int
    mean: float
    median: float
    std: float
    percentiles: tuple[tuple[float, float], ...]

    @classmethod
    def of(cls, values_s: Sequence[float], percentiles: Sequence[float]) -> Distribution:
        if len(values_s) == 0:
            return cls(0, 0.0, 0.0, 0.0, tuple((p, 0.0) for p in percentiles))
        ms = np.asarray(values_s, dtype=float) * 1000.0
        return cls(
            count=len(ms),
            mean=float(ms.mean()),
            median=float(np.median(ms)),
            std=float(ms.std()),
            percentiles=tuple((float(p), float(np.percentile(ms, p))) for p in percentiles),
        )


@dataclass(frozen=True)
class BenchmarkMetrics:
    """The summary of one run. Throughputs are per second of wall-clock ``duration_s``."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    # None when no goodput SLOs were given.
    request_goodput: float | None
    good_requests: int | None
    max_concurrent_requests: int
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    event_gap: Distribution
    e2el: Distribution

    def distribution(self, metric: str) -> Distribution:
        return getattr(self, metric)

    def to_summary(self) -> dict[str, Any]:
        """Flat keys in the style of vllm's result JSON (``mean_ttft_ms``, ``p99_itl_ms``...)."""
        out: dict[str, Any] = {
            "completed": self.completed,
            "failed": self.failed,
            "duration": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "good_requests": self.good_requests,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_concurrent_requests": self.max_concurrent_requests,
        }
        for metric in LATENCY_METRICS:
            dist = self.distribution(metric)
            out[f"mean_{metric}_ms"] = dist.mean
            out[f"median_{metric}_ms"] = dist.median
            out[f"std_{metric}_ms"] = dist.std
            for p, value in dist.percentiles:
                out[f"p{format_percentile(p)}_{metric}_ms"] = value
        return out


def format_percentile(p: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9": the label used in keys and the table."""
    return str(int(p)) if float(p).is_integer() else str(p)


def parse_percentiles(text: str) -> tuple[float, ...]:
    """Parse "50,90,99" into (50.0, 90.0, 99.0); raise ValueError on anything out of [0, 100]."""
    values: list[float] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"percentile {part!r} is not a number") from None
        if not 0.0 <= value <= 100.0:
            raise ValueError(f"percentile {value} is outside [0, 100]")
        values.append(value)
    if not values:
        raise ValueError("no percentiles given")
    return tuple(values)


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """Parse ["ttft:200", "tpot:50"] into {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {item!r} must be NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number") from None
        if ms < 0:
            raise ValueError(f"goodput SLO {item!r} must be >= 0 ms")
        slos[name] = ms
    return slos


def meets_slos(outcome: RequestOutcome, slos: Mapping[str, float]) -> bool:
    """True when a successful request is within every SLO (ms). A request with one output token
    has no TPOT and counts as TPOT 0, as vllm does."""
    if not outcome.success:
        return False
    values_ms = {
        "ttft": outcome.ttft * 1000.0,
        "tpot": (outcome.tpot or 0.0) * 1000.0,
        "e2el": outcome.latency * 1000.0,
    }
    return all(values_ms[name] <= limit for name, limit in slos.items())


def max_concurrency(outcomes: Iterable[RequestOutcome]) -> int:
    """Most requests in flight at once, from each request's [start, start + latency)."""
    events: list[tuple[float, int]] = []
    for o in outcomes:
        events.append((o.start_time, 1))
        events.append((o.start_time + o.latency, -1))
    # Ends sort before starts at the same instant so back-to-back requests do not overlap.
    events.sort(key=lambda e: (e[0], e[1]))
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def compute_metrics(
    outcomes: Sequence[RequestOutcome],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    goodput_slos: Mapping[str, float] | None = None,
) -> BenchmarkMetrics:
    """Summarise a run. Failed requests count only in ``failed``; their tokens and latencies are
    excluded, as in vllm."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    ok = [o for o in outcomes if o.success]
    input_tokens = sum(o.prompt_len for o in ok)
    output_tokens = sum(o.output_tokens for o in ok)
    tpots = [t for t in (o.tpot for o in ok) if t is not None]
    itls = [gap for o in ok for gap in o.itl]

    good: int | None = None
    goodput: float | None = None
    if goodput_slos:
        good = sum(1 for o in ok if meets_slos(o, goodput_slos))
        goodput = good / duration_s

    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(outcomes) - len(ok),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        request_goodput=goodput,
        good_requests=good,
        max_concurrent_requests=max_concurrency(outcomes),
        ttft=Distribution.of([o.ttft for o in ok], percentiles),
        tpot=Distribution.of(tpots, percentiles),
        itl=Distribution.of(itls, percentiles),
        event_gap=Distribution.of([gap for o in ok for gap in o.event_gaps], percentiles),
        e2el=Distribution.of([o.latency for o in ok], percentiles),
    )
