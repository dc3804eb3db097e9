"""`bench compare`: peer commands, shardserve variants and the ratio table."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from benchmarks.client import build_payload
from benchmarks.compare import (_serve_cmd, _variants, add_cli_args, client_config, engine_alone,
                                round_order, split_warmups, table)
from benchmarks.datasets import BenchRequest


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return p.parse_args(list(argv))


def test_variants_run_shardserve_with_its_flags_then_theirs() -> None:
    # a variant that dropped the common flags once measured a 0.5 GiB cache against an engine
    # peer with 8 GiB (two thirds of its streams queued) and passed for the variant's own cost
    args = _args("--shardserve-args", "--num-threads 2",
                 "--shardserve-variant", "si4=--stream-interval 4 --num-threads 1")
    assert _variants(args) == {"shardserve[si4]": "--stream-interval 4 --num-threads 1"}
    base = _serve_cmd("shardserve", args, Path("/m"), 9000)
    variant = _serve_cmd("shardserve[si4]", args, Path("/m"), 9001)
    assert base[-2:] == ["--num-threads", "2"] and "--stream-interval" not in base
    assert variant[-6:] == ["--num-threads", "2", "--stream-interval", "4", "--num-threads", "1"]
    with pytest.raises(ValueError, match="NAME=FLAGS"):
        _variants(_args("--shardserve-variant", "no-equals-sign"))


def test_peers_compute_in_the_dtype_shardserve_picks(tmp_path: Path) -> None:
    import transformers

    from replicas.kernels import isa
    transformers.LlamaConfig(dtype="bfloat16").save_pretrained(tmp_path)
    args = _args("--vllm-python", "/venv/bin/python", "--concurrency", "8")
    ours = _serve_cmd("shardserve", args, tmp_path, 9000)
    assert ours[ours.index("--dtype") + 1] == "auto"
    vllm = _serve_cmd("vllm", args, tmp_path, 9001)
    assert vllm[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    expected = "bfloat16" if isa.compute_dtype() == torch.bfloat16 else "float32"
    assert vllm[vllm.index("--dtype") + 1] == expected
    assert vllm[vllm.index("--max-num-seqs") + 1] == "8"
    fixed = _serve_cmd("vllm", _args("--vllm-python", "p", "--dtype", "bfloat16"), tmp_path, 1)
    assert fixed[fixed.index("--dtype") + 1] == "bfloat16"
    with pytest.raises(ValueError, match="--vllm-python"):
        _serve_cmd("vllm", _args(), tmp_path, 9002)


def test_warmups_are_not_measured() -> None:
    # every peer measures the same --num-prompts requests; the served peers once also measured
    # the warm-ups, whose stragglers ran almost alone at the end and cut their throughput
    from benchmarks.datasets import random_requests
    requests = random_requests(66, 16, 8, seed=0)
    warmups, measured = split_warmups(requests, 2)
    assert len(warmups) == 2 and len(measured) == 64
    assert not {id(r) for r in warmups} & {id(r) for r in measured}


def test_rounds_alternate_the_peers_order() -> None:
    # a box that drifts over the run must not favour whichever peer always goes first
    peers = ["engine", "shardserve", "vllm"]
    orders = [round_order(peers, r) for r in range(4)]
    assert orders == [peers, peers[::-1], peers, peers[::-1]]
    assert peers == ["engine", "shardserve", "vllm"]  # the caller's list is left as it was
    for a, b in (("engine", "shardserve"), ("shardserve", "vllm")):
        firsts = [o.index(a) < o.index(b) for o in orders]
        assert firsts.count(True) == firsts.count(False)


def test_table_has_a_ratio_column_per_shardserve_run() -> None:
    results = {"shardserve": [{"output_throughput": 200.0, "median_ttft_ms": 10.0,
                               "median_tpot_ms": 5.0}],
               "transformers-serve": [{"output_throughput": 50.0}],
               "shardserve[si4]": [{"output_throughput": 300.0}]}
    rows = table(results).splitlines()
    assert "shardserve / peer" in rows[0] and "shardserve[si4] / peer" in rows[0]
    peer_row = next(r for r in rows if r.startswith("transformers-serve"))
    assert peer_row.split()[-2:] == ["4.00x", "6.00x"]
    assert rows[1].split()[-2:] == ["1.00x", "1.50x"]


def test_rounds_report_medians_and_the_median_same_round_ratio() -> None:
    # the peer is slow in round 2 as ours is: the paired ratios are 2, 2, 3 (median 2), while
    # the ratio of the medians would be 200 / 100 = 2 only by chance of these numbers
    results = {"shardserve": [{"output_throughput": 200.0}, {"output_throughput": 60.0},
                              {"output_throughput": 300.0}],
               "engine": [{"output_throughput": 100.0}, {"output_throughput": 30.0},
                          {"output_throughput": 100.0}]}
    rows = table(results).splitlines()
    ours, engine = rows[1].split(), rows[2].split()
    assert ours[1] == "200.0" and engine[1] == "100.0"
    assert engine[-1] == "2.00x"


def test_the_engine_peer_runs_bench_engine_on_the_loads_shape() -> None:
    from benchmarks.datasets import load_tokenizer, random_requests
    from replicas.embedded import EMBEDDED_MODEL_ID
    from replicas.model_files import resolve_model_path

    path = resolve_model_path(EMBEDDED_MODEL_ID)
    tokenizer = load_tokenizer(str(path))
    args = _args("--concurrency", "2", "--num-prompts", "3", "--num-warmups", "1",
                 "--input-len", "12", "--output-len", "5", "--dtype", "float32",
                 "--temperature", "0")  # greedy, as `bench engine --temperature 0` takes it
    requests = random_requests(4, 12, 5, tokenizer=tokenizer, seed=0)
    result = engine_alone(path, requests, tokenizer, args)
    assert result["completed"] == 3 and result["total_output_tokens"] == 15
    assert result["output_throughput"] > 0 and result["decode_only_step_ms"] > 0
    # the chat template wraps each 12-token prompt: the engine gets at least that many tokens
    assert 12 < result["prompt_len"] < 60
    # the floors for the latency yardsticks, measured in the same subprocess
    assert result["weights_read_ms"] > 0 and result["prompt_forward_ms"] > 0
    assert result["prefill_ms_per_prompt_token"] > 0
    # the weights' bytes over the read's time: a bandwidth a CPU can have
    assert 1 < result["weights_bytes"] / result["weights_read_ms"] / 1e6 < 1000


def test_latencies_are_reported_against_the_same_rounds_floors() -> None:
    # round 2 ran on a slow machine (both ours and the floors doubled): the paired ratios stay
    results = {"shardserve": [{"output_throughput": 30.0, "median_tpot_ms": 25.0,
                               "median_ttft_ms": 130.0, "max_concurrent_requests": 1},
                              {"output_throughput": 15.0, "median_tpot_ms": 50.0,
                               "median_ttft_ms": 260.0, "max_concurrent_requests": 1}],
               "engine": [{"output_throughput": 40.0, "weights_read_ms": 20.0,
                           "prompt_forward_ms": 95.0},
                          {"output_throughput": 20.0, "weights_read_ms": 40.0,
                           "prompt_forward_ms": 195.0}]}
    last = table(results).splitlines()[-1]
    assert last.startswith(
        "shardserve: TPOT p50 / one read of the weights at the read bandwidth 1.25x")
    assert last.endswith("TTFT p50 / (bare forward over the prompt + 5 ms) 1.30x")
    # the served core's steps against the engine alone's, paired by round
    for mine, alone, step, prefill in zip(results["shardserve"], results["engine"],
                                          (33.0, 80.0), (0.72, 1.2)):
        mine.update(decode_only_step_ms=step, prefill_ms_per_prompt_token=prefill)
        alone.update(decode_only_step_ms=30.0, prefill_ms_per_prompt_token=0.6)
    assert table(results).splitlines()[-1] == (
        "shardserve: served / alone: decode-only step 1.88x, prefill steps' seconds per prompt "
        "token 1.60x")
    # without the engine peer there is no floor to report
    assert "one read" not in table({"shardserve": results["shardserve"]})
    # nor for a load of many streams: those yardsticks are one stream's
    for run in results["shardserve"]:
        run["max_concurrent_requests"] = 32
    assert "one read" not in table(results) and "served / alone" in table(results)


def test_tpot_is_also_paired_with_the_bandwidth_read_beside_its_own_load() -> None:
    # round 1's engine run met the box at 80 GB/s, its served run at 40: against the engine
    # run's read the served TPOT looks 2x worse than against the read beside its own load
    results = {"shardserve": [{"output_throughput": 30.0, "median_tpot_ms": 6.0,
                               "median_ttft_ms": 130.0, "read_gbps": (40.0, 40.0),
                               "max_concurrent_requests": 1},
                              {"output_throughput": 30.0, "median_tpot_ms": 3.5,
                               "median_ttft_ms": 130.0, "read_gbps": (70.0, 90.0),
                               "max_concurrent_requests": 1}],
               "engine": [{"output_throughput": 40.0, "weights_read_ms": 2.5,
                           "weights_bytes": 200e6, "prompt_forward_ms": 95.0},
                          {"output_throughput": 40.0, "weights_read_ms": 2.5,
                           "weights_bytes": 200e6, "prompt_forward_ms": 95.0}]}
    lines = table(results).splitlines()
    assert lines[-2].startswith(
        "shardserve: TPOT p50 / one read of the weights at the read bandwidth 1.90x")
    # 6.0 / 5.0 ms and 3.5 / 2.5 ms: the median of 1.2x and 1.4x
    assert lines[-1] == (
        "shardserve: TPOT p50 / one read of the weights at the bandwidth read just before and "
        "after its load 1.30x (6.00 / 5.00 ms (40.0, 40.0 GB/s); 3.50 / 2.50 ms (70.0, 90.0 "
        "GB/s))")


def test_front_costs_divide_the_load_s_counters() -> None:
    from benchmarks.compare import _front_costs

    before = {"front_cpu_s": 1.0, "core_cpu_s": 10.0, "ingress_cpu_s": 3.0, "steps": 100.0,
              "messages": 50.0, "decode_steps": 90.0, "decode_step_s": 2.7,
              "prefill_step_s": 1.0, "prompt_tokens": 1000.0, "held_steps": 7.0,
              "other_cpu_s:ray::StatusBoard": 1.0, "other_cpu_s:raylet": 2.0,
              "other_cpu_s:gcs_server": 0.5}
    after = {"front_cpu_s": 2.0, "core_cpu_s": 30.0, "ingress_cpu_s": 5.0, "steps": 600.0,
             "messages": 1050.0, "decode_steps": 590.0, "decode_step_s": 17.7,
             "prefill_step_s": 4.0, "prompt_tokens": 6000.0, "held_steps": 47.0,
             "other_cpu_s:ray::StatusBoard": 1.5, "other_cpu_s:raylet": 3.0,
             "other_cpu_s:gcs_server": 0.51}
    costs = _front_costs(before, after, 20000)
    assert costs["engine_steps"] == 500.0 and costs["held_steps"] == 40.0
    assert costs["front_cpu_ms_per_step"] == 2.0 and costs["stream_messages"] == 1000.0
    # the other processes by CPU, most first, those under 0.05 s left out
    assert list(costs["other_cpu_s"].items()) == [("raylet", 1.0), ("ray::StatusBoard", 0.5)]
    assert costs["ingress_cpu_s"] == 2.0 and costs["ingress_cpu_us_per_token"] == 100.0
    assert abs(costs["decode_only_step_ms"] - 30.0) < 1e-9
    assert abs(costs["prefill_ms_per_prompt_token"] - 0.6) < 1e-9


def test_the_client_s_own_cpu_is_reported_per_output_token() -> None:
    # a client that cannot keep up inflates the server's TTFT and TPOT: its cost is in the report
    results = {"shardserve": [{"output_throughput": 100.0, "client_processes": 4,
                               "client_cpu_s": 3.0, "total_output_tokens": 30000},
                              {"output_throughput": 90.0, "client_processes": 4,
                               "client_cpu_s": 5.0, "total_output_tokens": 30000}]}
    assert table(results).splitlines()[-1] == (
        "shardserve: the client's 4 process(es) 4.0 s of CPU, 133 us per output token")


def test_temperature_goes_in_every_request_body() -> None:
    request = BenchRequest(prompt="hi", prompt_len=1, output_len=4)
    greedy = build_payload(client_config("http://x", "m", _args("--temperature", "0"), True),
                           request)
    assert greedy["temperature"] == 0 and greedy["ignore_eos"] is True
    assert "temperature" not in build_payload(client_config("http://x", "m", _args(), True),
                                              request)
