"""Runs one step on the shard workers: in-process at tp=1 (no hop); at tp>1 rank 0 in-process and
the others on Ray actors (`ray_executor.RayExecutor`, a module of its own so that a core at tp=1
never imports Ray)."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from replicas.model_runner import StepInput, StepOutput
from replicas.worker import ShardWorker, WorkerConfig


class Executor(Protocol):
    def execute(self, step: StepInput) -> StepOutput: ...

    def shard_sizes(self) -> list[int]: ...

    def weight_formats(self) -> dict[str, int]: ...

    def cuda_graphs(self) -> bool: ...  # whether steps replay CUDA graphs

    def num_blocks(self) -> int: ...  # the KV blocks every shard holds

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    def __init__(self, config: WorkerConfig) -> None:
        self.worker = ShardWorker(dataclasses.replace(config, logits_on_device=True))

    def execute(self, step: StepInput) -> StepOutput:
        return self.worker.execute(step)  # type: ignore[return-value]  # rank 0 always answers

    def shard_sizes(self) -> list[int]:
        return [self.worker.num_parameters()]

    def weight_formats(self) -> dict[str, int]:
        return self.worker.weight_formats()

    def cuda_graphs(self) -> bool:
        return self.worker.runner.graphs is not None

    def num_blocks(self) -> int:
        return self.worker.num_blocks

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None
