"""PNG plots from ``bench serve`` result files: latency CDFs (TTFT, TPOT, E2E) with one curve
per file, and throughput/latency vs concurrency when the files differ in concurrency."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.metrics import METRIC_TITLES
from benchmarks.records import RequestOutcome

CDF_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class LoadedResult:
    """One result file, reduced to what the plots use."""

    path: Path
    label: str
    series: str
    concurrency: int | None
    summary: Mapping[str, Any]
    outcomes: tuple[RequestOutcome, ...]

    def latencies_ms(self, metric: str) -> list[float]:
        ok = [o for o in self.outcomes if o.success]
        if metric == "ttft":
            return [o.ttft * 1000 for o in ok]
        if metric == "tpot":
            return [o.tpot * 1000 for o in ok if o.tpot is not None]
        if metric == "e2el":
            return [o.latency * 1000 for o in ok]
        raise ValueError(f"unknown metric {metric!r}")


def load_result(path: str | Path) -> LoadedResult:
    path = Path(path)
    doc = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or "requests" not in doc:
        raise ValueError(f"{path}: not a bench serve result file (no 'requests')")
    config = doc.get("config") or {}
    summary = doc.get("summary") or {}
    # Configured cap when there was one; otherwise the observed peak stands in for it.
    concurrency = config.get("max_concurrency") or summary.get("max_concurrent_requests")
    return LoadedResult(
        path=path,
        label=str(config.get("label") or path.stem),
        # Files from the same server and model form one line in the concurrency plot.
        series=f"{config.get('model', '?')} @ {config.get('base_url', '?')}",
        concurrency=int(concurrency) if concurrency else None,
        summary=summary,
        outcomes=tuple(RequestOutcome.from_dict(r) for r in doc["requests"]),
    )


def plot(result_files: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Write ``cdf_ttft.png``, ``cdf_tpot.png``, ``cdf_e2el.png`` and, when the files cover two or
    more concurrency levels, ``throughput_vs_concurrency.png`` into ``out_dir``; return the paths."""
    if not result_files:
        raise ValueError("no result files to plot")
    # Imported here (Agg first) so importing this module for its CLI flags stays cheap and headless.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [load_result(p) for p in result_files]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    for metric in CDF_METRICS:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for result in results:
            values = sorted(result.latencies_ms(metric))
            if not values:
                continue
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, fractions, where="post", label=result.label)
        ax.set_title(f"{METRIC_TITLES[metric]} CDF")
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        path = out / f"cdf_{metric}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    levels = {r.concurrency for r in results if r.concurrency is not None}
    if len(levels) >= 2:
        written.append(_plot_concurrency(plt, results, out))
    return written


def _plot_concurrency(plt: Any, results: Sequence[LoadedResult], out: Path) -> Path:
    panels = (
        ("output_throughput", "output tokens/s"),
        ("request_throughput", "requests/s"),
        ("median_ttft_ms", "median TTFT (ms)"),
        ("median_tpot_ms", "median TPOT (ms)"),
    )
    by_series: dict[str, list[LoadedResult]] = defaultdict(list)
    for r in results:
        if r.concurrency is not None:
            by_series[r.series].append(r)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, title) in zip(axes.flat, panels):
        for series, members in by_series.items():
            members = sorted(members, key=lambda r: r.concurrency or 0)
            points = [(r.concurrency, r.summary[key]) for r in members if isinstance(r.summary.get(key), (int, float))]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=series)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(title)
        ax.grid(True, alpha=0.3)
    if axes.flat[0].get_legend_handles_labels()[0]:
        axes.flat[0].legend(fontsize="small")
    fig.suptitle("Throughput and latency vs concurrency")
    fig.tight_layout()
    path = out / "throughput_vs_concurrency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("result_files", nargs="+", help="result JSON files written by bench serve --result-json")
    parser.add_argument("--out-dir", default="bench_plots", help="directory for the PNGs")


def run_cli(args: argparse.Namespace) -> int:
    try:
        paths = plot(args.result_files, args.out_dir)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0
