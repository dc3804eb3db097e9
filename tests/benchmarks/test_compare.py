"""`bench compare`: peer commands, shardserve variants and the ratio table."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks.compare import _serve_cmd, _variants, add_cli_args, table


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return p.parse_args(list(argv))


def test_variants_run_shardserve_with_their_flags() -> None:
    args = _args("--shardserve-args", "--num-threads 2",
                 "--shardserve-variant", "si4=--stream-interval 4")
    assert _variants(args) == {"shardserve[si4]": "--stream-interval 4"}
    base = _serve_cmd("shardserve", args, Path("/m"), 9000)
    variant = _serve_cmd("shardserve[si4]", args, Path("/m"), 9001)
    assert base[-2:] == ["--num-threads", "2"] and "--stream-interval" not in base
    assert variant[-2:] == ["--stream-interval", "4"] and "--num-threads" not in variant
    with pytest.raises(ValueError, match="NAME=FLAGS"):
        _variants(_args("--shardserve-variant", "no-equals-sign"))


def test_table_has_a_ratio_column_per_shardserve_run() -> None:
    results = {"shardserve": {"output_throughput": 200.0, "median_ttft_ms": 10.0,
                              "median_tpot_ms": 5.0},
               "transformers-serve": {"output_throughput": 50.0},
               "shardserve[si4]": {"output_throughput": 300.0}}
    rows = table(results).splitlines()
    assert "shardserve / peer" in rows[0] and "shardserve[si4] / peer" in rows[0]
    peer_row = next(r for r in rows if r.startswith("transformers-serve"))
    assert peer_row.split()[-2:] == ["4.00x", "6.00x"]
    assert rows[1].split()[-2:] == ["1.00x", "1.50x"]
