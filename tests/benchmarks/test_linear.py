"""`bench linear`: the native kernel and torch on a model's layer shapes, with a ratio per row
count."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.linear import add_cli_args, layer_shapes, run
from replicas import kernels


def test_layer_shapes_are_the_projections() -> None:
    import transformers
    config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536,
                                      num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    assert layer_shapes(config) == [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576),
                                    ("down", 576, 1536)]


@pytest.mark.skipif(kernels.load() is None, reason="no native kernels here")
def test_bench_linear_times_both_on_every_row_count() -> None:
    p = argparse.ArgumentParser()
    add_cli_args(p)
    args = p.parse_args(["--model", "shardserve/tiny-llama", "--rows", "1,7", "--rounds", "1"])
    result = run(args)
    assert [r["rows"] for r in result["rows"]] == [1, 7]
    assert result["fma_peak_gflops"] > 0
    for r in result["rows"]:
        assert r["native_ms"] > 0 and r["torch_ms"] > 0
        assert r["speedup"] == pytest.approx(r["torch_ms"] / r["native_ms"])
        assert r["native_of_peak"] == pytest.approx(r["native_gflops"] / result["fma_peak_gflops"])
        # bf16 weights: the kernel reads half the bytes torch's float32 weights take
        assert r["native_weight_gbs"] / r["torch_weight_gbs"] == pytest.approx(
            r["speedup"] / 2, rel=0.05)
