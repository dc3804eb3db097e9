"""Runs one step at tp > 1: rank 0 in the engine core's own process, ranks 1..N-1 on `ShardWorker`
Ray actors in the replica's placement group.

Rank 0 living in the core (as vLLM's driver worker did) means the logits of the sampling rows
never cross Ray, and each step leaves the core once per peer rank, as a delta
(`model_runner.StepInput`)."""

from __future__ import annotations

import dataclasses
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
    """Rank r > 0 goes into bundle r of the replica's placement group (bundle 0 holds the replica,
    its core and rank 0); child actors are not captured by the group implicitly, so each is placed
    by index. Build it on the thread that will run its steps (rank 0's torch work)."""

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
        self.peers = []
        for rank in range(1, config.tp_size):
            options: dict = {"num_cpus": num_cpus_per_worker, "num_gpus": num_gpus_per_worker}
            if name_prefix:
                options["name"] = f"{name_prefix}-rank{rank}"
            if pg is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank)
            self.peers.append(actor.options(**options).remote(config, rank, dist_init))
        try:
            # joins the peers' process group (their constructors are running by now)
            self.rank0 = ShardWorker(dataclasses.replace(config, logits_on_device=True), 0,
                                     dist_init)
            ray.get([w.ping.remote() for w in self.peers])
        except BaseException:
            self.shutdown()
            raise

    def execute(self, step: StepInput) -> StepOutput:
        refs = [w.execute.remote(step) for w in self.peers]
        out = self.rank0.execute(step)
        # a dead peer fails rank 0's collectives (gloo/NCCL see the connection go) or this wait
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=STEP_TIMEOUT_S)
        if pending:
            raise TimeoutError(f"a shard worker did not finish a step in {STEP_TIMEOUT_S} s")
        ray.get(ready)
        return out  # type: ignore[return-value]  # rank 0 always answers

    def shard_sizes(self) -> list[int]:
        return [self.rank0.num_parameters(),
                *ray.get([w.num_parameters.remote() for w in self.peers])]

    def weight_formats(self) -> dict[str, int]:
        return self.rank0.weight_formats()

    def cuda_graphs(self) -> bool:
        return False  # a graph cannot hold the peers' collectives' host side

    def num_blocks(self) -> int:
        # each rank sized its cache from its own GPU's free memory: the block manager hands
        # out only the blocks every rank has
        return min([self.rank0.kv_blocks(), *ray.get([w.kv_blocks.remote() for w in self.peers])])

    def check_health(self) -> None:
        ray.get([w.ping.remote() for w in self.peers], timeout=30)

    def shutdown(self) -> None:
        for w in self.peers:
            ray.kill(w)
