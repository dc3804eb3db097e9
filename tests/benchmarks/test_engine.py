"""`bench engine --core process`: the same load with the engine core in a process of its own."""

from __future__ import annotations

import argparse

from benchmarks.engine import add_cli_args, run
from replicas.embedded import EMBEDDED_MODEL_ID


def test_the_core_in_its_own_process_serves_the_whole_load() -> None:
    p = argparse.ArgumentParser()
    add_cli_args(p)
    args = p.parse_args(["--model", EMBEDDED_MODEL_ID, "--num-seqs", "3", "--min-input-len", "8",
                         "--max-input-len", "8", "--min-output-len", "5", "--max-output-len", "5",
                         "--kv-cache-gib", "0.05", "--core", "process"])
    result = run(args)
    assert result["core"] == "process" and result["output_tokens"] == 15
    # every token came from the core's steps, counted there: at least 5 steps for 5 tokens each
    assert result["steps"] >= 5 and result["forward_s"] > 0
    assert 0 < result["forward_s"] <= result["elapsed_s"]
    assert "roofline_decode_step_ms_at_batch" not in result  # the model is not in this process
