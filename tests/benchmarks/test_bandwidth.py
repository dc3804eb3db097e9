"""`bench bandwidth`: every memory-bound kernel timed on data past the caches, its bytes and its
share of the read bandwidth measured beside it."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import bandwidth
from replicas import kernels


@pytest.mark.skipif(kernels.load() is None, reason="no native kernels here")
def test_bench_bandwidth_times_each_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bandwidth, "STREAM_BYTES", 4 << 20)  # the logic, not the memory system
    monkeypatch.setattr(bandwidth, "CHUNK_BYTES", 1 << 20)
    p = argparse.ArgumentParser()
    bandwidth.add_cli_args(p)
    result = bandwidth.run(p.parse_args(["--model", "shardserve/tiny-llama", "--rounds", "1"]))
    names = [r["kernel"] for r in result["kernels"]]
    for kernel in ("paged decode attention", "add + RMSNorm", "RoPE + cache store", "silu * up",
                   "Q4_1 linear_q"):
        assert any(n.startswith(kernel) for n in names), names
    for r in result["kernels"]:
        assert r["bytes"] > 0 and r["ms"] > 0 and r["read_bandwidth_gb_s"] > 0
        assert r["of_bandwidth"] == pytest.approx(r["gb_s"] / r["read_bandwidth_gb_s"])
