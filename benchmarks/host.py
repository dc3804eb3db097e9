"""`bench host`: the engine core's host work per step without a model: the runner turning a step
(`StepInput`) into its tensors (`ModelRunner.update_tables` + `prepare`), and the sampler over
[rows, vocab] logits, for decode batches with and without new prompts beside them and for the
sampling parameters users send. Imports neither Ray nor a model.

    shardserve bench host --rows 1,32,256 --context 1000 --prompts 50 --vocab 4032,49152
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from replicas.model_runner import ModelRunner, RowInput, StepInput
from replicas.request import SamplingParams, Sequence
from replicas.sampler import sample
from replicas.sampling_batch import SamplingBatch

BLOCK = 16
# (name, params, logit scale): peaked logits (a confident model) and flat ones (a top_p set that
# spreads over much of the vocabulary)
SAMPLINGS: list[tuple[str, SamplingParams, float]] = [
    ("greedy", SamplingParams(max_tokens=1, temperature=0.0), 8.0),
    ("temperature 1", SamplingParams(max_tokens=1), 8.0),
    ("top_p 0.9 peaked", SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9), 8.0),
    ("top_p 0.9 flat", SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9), 1.0),
    ("top_k 50 flat", SamplingParams(max_tokens=1, top_k=50), 1.0),
    ("min_p 0.1 flat", SamplingParams(max_tokens=1, temperature=0.7, min_p=0.1), 1.0),
]


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", default="1,32,256", help="decoding rows per step")
    p.add_argument("--context", type=int, default=1000, help="tokens each decoding row holds")
    p.add_argument("--prompts", type=int, default=50,
                   help="137-token prompts beside the decode rows in the mixed steps")
    p.add_argument("--vocab", default="4032,49152", help="vocabulary sizes for the sampler")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--num-threads", type=int, default=0, help="torch threads (0: torch's)")
    p.add_argument("--result-json", type=Path)


def _best_us(fn: Callable[[], Any], repeats: int) -> float:
    """The best of three runs of `repeats` calls, microseconds a call."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - started) / repeats)
    return best * 1e6


def prepare_us(rows: int, context: int, prompts: int, steps: int) -> float:
    """update_tables + prepare per step: `rows` decoding rows (one token, a block id when a table
    grows) and `prompts` new 137-token prompts each step."""
    blocks_per_row = context // BLOCK + steps // BLOCK + 2
    blocks = rows * blocks_per_row + 9 * prompts * (steps + 1)
    # a bf16 cache, as served: on CPUs the native kernels take every token as a decode row
    kv = torch.zeros(1, 2, 1, blocks * BLOCK, 8, dtype=torch.bfloat16)
    runner = ModelRunner(None, kv, BLOCK)  # type: ignore[arg-type]
    first = StepInput(tuple(RowInput((1,), context, tuple(range(i * blocks_per_row,
                                                                (i + 1) * blocks_per_row)),
                                     True, seq_id=i) for i in range(rows)))
    runner.prepare(first, runner.update_tables(first))
    next_block = rows * blocks_per_row
    step_inputs = []
    for s in range(steps):
        decode = [RowInput((5,), context + 1 + s, (), True, seq_id=i) for i in range(rows)]
        new = []
        for j in range(prompts):
            table = tuple(range(next_block, next_block + 9))
            next_block += 9
            new.append(RowInput(tuple(range(137)), 0, table, True, seq_id=10**6 + s * prompts + j))
        freed = tuple(10**6 + (s - 1) * prompts + j for j in range(prompts)) if s else ()
        step_inputs.append(StepInput(tuple(decode + new), freed))
    cycle = itertools.cycle(step_inputs)

    def one() -> None:
        step = next(cycle)
        runner.prepare(step, runner.update_tables(step))
    # every repeat replays the same steps: their decode rows' positions stay within the tables
    return _best_us(one, steps)


def sample_us(rows: int, vocab: int, params: SamplingParams, scale: float) -> float:
    """The sampler for `rows` rows of [vocab] logits, its parameters kept between steps."""
    seqs = [Sequence(i, f"r{i}", 0, list(range(100)), 90, params) for i in range(rows)]
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * scale
    batch = SamplingBatch()
    work = logits.clone()

    def one() -> None:
        work.copy_(logits)  # the sampler writes into its logits
        sample(work, seqs, frozenset({2}), None, batch.params(seqs, vocab, logits.device))
    copy = _best_us(lambda: work.copy_(logits), 20)
    return max(_best_us(one, 20) - copy, 0.0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    rows = [int(r) for r in args.rows.split(",")]
    out: dict[str, Any] = {"prepare_us": {}, "sample_us": {}}
    for r in rows:
        for prompts in (0, args.prompts):
            key = f"{r} rows x {args.context} tokens + {prompts} prompts"
            out["prepare_us"][key] = prepare_us(r, args.context, prompts, args.steps)
            print(f"prepare  {key:<40} {out['prepare_us'][key]:10.0f} us")
    for vocab in (int(v) for v in args.vocab.split(",")):
        for r in rows:
            for name, params, scale in SAMPLINGS:
                key = f"{r} rows x {vocab} vocab, {name}"
                out["sample_us"][key] = sample_us(r, vocab, params, scale)
                print(f"sample   {key:<40} {out['sample_us'][key]:10.0f} us")
    return out


def run_cli(args: argparse.Namespace) -> int:
    result = run(args)
    if args.result_json:
        args.result_json.write_text(json.dumps(result, indent=2))
    return 0
