"""Runs one step on N `ShardWorker` Ray actors placed in the replica's placement group (tp>1:
every rank computes; rank 0 answers)."""

from __future__ import annotations

import socket

import ray
from ray._raylet import PlacementGroupID
from ray.util.placement_group import PlacementGroup, get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from replicas.model_runner import StepInput, StepOutput
from replicas.worker import ShardWorker, WorkerConfig

STEP_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayExecutor:
    """Shard actors go into bundles 1..N of the replica's placement group (bundle 0 is the replica
    itself); child actors are not captured by the group implicitly, so each is placed by index."""

    def __init__(self, config: WorkerConfig, num_cpus_per_worker: float,
                 num_gpus_per_worker: float, name_prefix: str | None = None,
                 placement_group_id: bytes | None = None) -> None:
        """`placement_group_id`: the replica's group, when this runs in its engine-core process
        (a Ray driver of its own, outside the group)."""
        pg = (PlacementGroup(PlacementGroupID(placement_group_id))
              if placement_group_id is not None else get_current_placement_group())
        host = ray.util.get_node_ip_address()
        dist_init = f"tcp://{host}:{_free_port()}"
        actor = ray.remote(ShardWorker)
        self.workers = []
        for rank in range(config.tp_size):
            options: dict = {"num_cpus": num_cpus_per_worker, "num_gpus": num_gpus_per_worker}
            if name_prefix:
                options["name"] = f"{name_prefix}-rank{rank}"
            if pg is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank + 1)
            self.workers.append(actor.options(**options).remote(config, rank, dist_init))
        ray.get([w.ping.remote() for w in self.workers])

    def execute(self, step: StepInput) -> StepOutput:
        refs = [w.execute.remote(step) for w in self.workers]
        # results are taken as they come, so a dead rank fails the step at once instead of
        # leaving rank 0 waiting in a collective for its peer
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=STEP_TIMEOUT_S)
            if not ready:
                raise TimeoutError(f"a shard worker did not finish a step in {STEP_TIMEOUT_S} s")
            ray.get(ready[0])
        return ray.get(refs[0])

    def shard_sizes(self) -> list[int]:
        return ray.get([w.num_parameters.remote() for w in self.workers])

    def weight_formats(self) -> dict[str, int]:
        return ray.get(self.workers[0].weight_formats.remote())

    def cuda_graphs(self) -> bool:
        return False  # a graph cannot hold the actors' round trips of tp > 1

    def num_blocks(self) -> int:
        # each rank sized its cache from its own GPU's free memory: the block manager hands
        # out only the blocks every rank has
        return min(ray.get([w.kv_blocks.remote() for w in self.workers]))

    def check_health(self) -> None:
        ray.get([w.ping.remote() for w in self.workers], timeout=30)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
