"""Plots are written as PNGs from result files."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.metrics import compute_metrics
from benchmarks.plot import plot
from benchmarks.records import RequestOutcome


def _result(path: Path, concurrency: int, scale: float) -> Path:
    outcomes = [
        RequestOutcome(
            True,
            10,
            8,
            8,
            ttft=0.05 * scale * (1 + i % 3),
            itl=(0.01 * scale,) * 7,
            latency=0.05 * scale + 0.07 * scale,
            start_time=0.01 * i,
        )
        for i in range(20)
    ] + [RequestOutcome(False, 10, 0, 8, error="HTTP 500")]
    doc = {
        "config": {"max_concurrency": concurrency, "label": f"c{concurrency}", "model": "m", "base_url": "http://h"},
        "summary": compute_metrics(outcomes, 1.0).to_summary(),
        "requests": [o.to_dict() for o in outcomes],
    }
    path.write_text(json.dumps(doc))
    return path


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_cdfs_and_concurrency_sweep(tmp_path: Path) -> None:
    files = [_result(tmp_path / f"c{c}.json", c, s) for c, s in ((1, 1.0), (4, 1.5), (16, 3.0))]
    written = plot(files, tmp_path / "plots")
    names = sorted(p.name for p in written)
    assert names == ["cdf_e2el.png", "cdf_tpot.png", "cdf_ttft.png", "throughput_vs_concurrency.png"]
    assert all(_is_png(p) for p in written)


def test_single_file_gets_only_cdfs(tmp_path: Path) -> None:
    written = plot([_result(tmp_path / "one.json", 8, 1.0)], tmp_path / "out")
    assert sorted(p.name for p in written) == ["cdf_e2el.png", "cdf_tpot.png", "cdf_ttft.png"]
    assert all(_is_png(p) for p in written)
