"""Human-readable rendering of a run's summary: the ``vllm bench serve`` style result table."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from benchmarks.metrics import LATENCY_METRICS, METRIC_TITLES, BenchmarkMetrics, format_percentile
from benchmarks.records import RequestOutcome

_WIDTH = 50


def _rule(title: str = "", fill: str = "-") -> str:
    return f"{title:{fill}^{_WIDTH}}"


def _row(label: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40} {value!s:<10}"


def format_table(
    metrics: BenchmarkMetrics,
    max_concurrency: int | None = None,
    request_rate: float | None = None,
    goodput_slos: Mapping[str, float] | None = None,
) -> str:
    """The result table: counts and throughputs, then mean/median/percentiles per latency metric."""
    lines = [_rule(" Serving Benchmark Result ", "=")]
    lines.append(_row("Successful requests:", metrics.completed))
    lines.append(_row("Failed requests:", metrics.failed))
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if request_rate is not None:
        lines.append(_row("Request rate configured (RPS):", request_rate))
    lines.append(_row("Benchmark duration (s):", metrics.duration_s))
    lines.append(_row("Total input tokens:", metrics.total_input_tokens))
    lines.append(_row("Total generated tokens:", metrics.total_output_tokens))
    lines.append(_row("Request throughput (req/s):", metrics.request_throughput))
    if metrics.request_goodput is not None:
        slos = ", ".join(f"{k}<={v:g}ms" for k, v in (goodput_slos or {}).items())
        lines.append(_row("Request goodput (req/s):", metrics.request_goodput))
        if slos:
            lines.append(_row("  SLOs:", slos))
    lines.append(_row("Output token throughput (tok/s):", metrics.output_throughput))
    lines.append(_row("Total token throughput (tok/s):", metrics.total_token_throughput))
    lines.append(_row("Peak concurrent requests:", metrics.max_concurrent_requests))
    for metric in LATENCY_METRICS:
        dist = metrics.distribution(metric)
        name = metric.upper().replace("_", " ")
        lines.append(_rule(METRIC_TITLES[metric]))
        lines.append(_row(f"Mean {name} (ms):", dist.mean))
        lines.append(_row(f"Median {name} (ms):", dist.median))
        for p, value in dist.percentiles:
            lines.append(_row(f"P{format_percentile(p)} {name} (ms):", value))
    lines.append(_rule(fill="="))
    return "\n".join(lines)


def format_errors(outcomes: Iterable[RequestOutcome], limit: int = 5) -> str:
    """The most common failure messages with counts; empty when nothing failed."""
    counts = Counter(o.error for o in outcomes if not o.success)
    if not counts:
        return ""
    lines = [f"{sum(counts.values())} request(s) failed; most common errors:"]
    for error, n in counts.most_common(limit):
        lines.append(f"  {n:>6} x {error[:300]}")
    return "\n".join(lines)
