"""Runs a fixed sequence of steps (prefill, a chunk over a cached prefix, decode, in mixed steps)
on a model folder in a process of its own, so that `SHARDSERVE_ISA` picks the kernels' build:
`python -m tests.replicas.isa_steps MODEL_DIR DTYPE OUT` saves each step's logits to OUT."""

from __future__ import annotations

import sys

import torch

from replicas.model_runner import RowInput, StepInput

BLOCK = 4
A, B, C = [5, 17, 42, 7, 99, 3], list(range(40, 61)), [8, 1, 250, 33, 2, 77, 9]
TA, TB, TC = (2, 11, 30), (7, 3, 14, 20, 9, 16), (25, 5, 31)


def run(worker) -> list[tuple[list[list[int]], torch.Tensor]]:
    """Three steps, greedy: prefill of A and B's first 10 tokens; A's next token beside the rest
    of B (over its cached prefix) and all of C; a decode step of all three. Returns each step's
    (rows' full sequences, logits) for the rows that produce one."""
    a, b, c = list(A), list(B), list(C)
    first = worker.execute(StepInput((RowInput(tuple(a), 0, TA, True),
                                      RowInput(tuple(b[:10]), 0, TB, False))))
    out = [([list(a)], first.logits.float())]
    a.append(int(first.logits[0].argmax()))
    second = worker.execute(StepInput((RowInput((a[-1],), len(a) - 1, TA, True),
                                       RowInput(tuple(b[10:]), 10, TB, True),
                                       RowInput(tuple(c), 0, TC, True))))
    out.append(([list(a), list(b), list(c)], second.logits.float()))
    for seq, logits in zip((a, b, c), second.logits):
        seq.append(int(logits.argmax()))
    third = worker.execute(StepInput(tuple(
        RowInput((seq[-1],), len(seq) - 1, table, True)
        for seq, table in zip((a, b, c), (TA, TB, TC)))))
    out.append(([list(a), list(b), list(c)], third.logits.float()))
    return out


def main() -> None:
    from replicas.kernels import isa
    from replicas.worker import ShardWorker, WorkerConfig
    folder, dtype, out = sys.argv[1:4]
    worker = ShardWorker(WorkerConfig(folder, dtype, num_blocks=40, block_size=BLOCK))
    model = worker.runner.model
    torch.save({"isa": isa.selected(), "steps": run(worker),
                "head_packed": model.lm_head.weight.dim(),
                "native_layers": model._native_table is not None
                and model._native_table[1] is not None}, out)


if __name__ == "__main__":
    main()
