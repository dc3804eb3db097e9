"""`bench step`: the decode step alone against the bandwidth bound, without Ray or the engine."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import psutil
import pytest

from benchmarks import step
from benchmarks.interference import Interferers


def test_step_times_each_batch_and_its_bound(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    step.add_cli_args(parser)
    args = parser.parse_args(["--model", "shardserve/tiny-llama", "--batch-sizes", "1,4",
                              "--context", "40", "--repeats", "3",
                              "--result-json", str(tmp_path / "r.json")])
    assert step.run_cli(args) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["device"] == "cpu" and result["weight_bytes"] > 4e6 * 4
    # --dtype auto, as the server resolves it: the float32 checkpoint computes in float32
    assert (result["dtype"], result["kv_cache_dtype"]) == ("float32", "float32")
    steps = result["steps"]
    assert set(steps) == {"1", "4"}
    # a bigger batch reads more cache, so its bound is higher; every step takes some time
    assert steps["4"]["bandwidth_bound_ms"] > steps["1"]["bandwidth_bound_ms"] > 0
    assert all(s["median_ms"] >= s["min_ms"] > 0 for s in steps.values())


def test_small_pages_peer_steps_the_same_weights_off_the_huge_page_mapping(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    step.add_cli_args(parser)
    args = parser.parse_args(["--model", "shardserve/tiny-llama", "--batch-sizes", "1",
                              "--context", "40", "--repeats", "3", "--dtype", "float32",
                              "--small-pages-peer", "--result-json", str(tmp_path / "r.json")])
    assert step.run_cli(args) == 0
    one = json.loads((tmp_path / "r.json").read_text())["steps"]["1"]
    assert one["small_pages_median_ms"] > 0 and one["median_ms"] > 0


def test_runs_without_ray_or_the_serving_stack() -> None:
    """What lets it run on a bare GPU machine: importing it pulls in neither Ray nor FastAPI."""
    code = ("import sys, benchmarks.step, replicas.worker, replicas.model_files, "
            "replicas.engine_core; "
            "print(sorted(m for m in ('ray', 'fastapi', 'outlines') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_interferers_take_their_share_beside_the_step_and_are_gone_after(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    step.add_cli_args(parser)
    args = parser.parse_args(["--model", "shardserve/tiny-llama", "--batch-sizes", "1",
                              "--context", "40", "--repeats", "6", "--interferers", "2",
                              "--interferer-burst-us", "2000", "--interferer-period-us", "4000",
                              "--result-json", str(tmp_path / "r.json")])
    before = {p.pid for p in psutil.Process().children()}
    assert step.run_cli(args) == 0
    one = json.loads((tmp_path / "r.json").read_text())["steps"]["1"]
    # two processes busy half the time: about one core's worth while they ran
    assert 0.1 < one["interferers_share"] * (os.cpu_count() or 1) < 1.5
    assert one["beside_interferers_median_ms"] > 0 and one["beside_over_alone"] > 0
    assert one["loss_over_share"] is not None
    assert {p.pid for p in psutil.Process().children()} <= before


def test_interferers_refuse_a_burst_longer_than_their_period() -> None:
    with pytest.raises(ValueError, match="shorter than its period"):
        Interferers(1, 0.002, 0.001)
