"""The prefix-aware request router's choices, called as Serve calls it (no Ray): a request goes to
the replica holding its prefix, never to one whose engine core is down while another takes
requests; a channel goes to the replica it names, and to a live one where that one is gone."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from replicas.channel import ChannelOpen
from replicas.request import GenerateRequest, SamplingParams
from replicas.router import BLOCK, PrefixAffinityRouter

DEPLOYMENT = DeploymentID(name="LLMReplica-m", app_name="shardserve")
PROMPT = tuple(range(4 * BLOCK))


@dataclass
class Replica:
    """What the router reads of Serve's RunningReplica."""

    name: str
    routing_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def replica_id(self) -> ReplicaID:
        return ReplicaID(self.name, DEPLOYMENT)


def _router() -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(deployment_id=DEPLOYMENT,
                                  handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(imbalance=8)
    return router


def _pending(arg: Any, rid: str) -> SimpleNamespace:
    return SimpleNamespace(args=[arg], kwargs={},
                           metadata=SimpleNamespace(internal_request_id=rid),
                           future=asyncio.get_running_loop().create_future())


def _request(rid: str) -> GenerateRequest:
    return GenerateRequest(rid, PROMPT, SamplingParams(max_tokens=4))


def _names(choice: list[list[Replica]]) -> list[set[str]]:
    return [{r.name for r in rank} for rank in choice]


async def test_a_request_follows_its_prefix_to_the_replica_that_holds_it() -> None:
    router, a, b = _router(), Replica("a"), Replica("b")
    first = _pending(_request("r1"), "r1")
    router.on_request_routed(first, b.replica_id, None)
    router.on_request_completed(b.replica_id, "r1")
    assert _names(await router.choose_replicas([a, b], _pending(_request("r2"), "r2"))) == [
        {"b"}, {"a"}]


async def test_a_replica_whose_engine_is_down_gets_no_requests_while_another_takes_them() -> None:
    router, a, b = _router(), Replica("a"), Replica("b", {"engine_up": False})
    router.on_request_routed(_pending(_request("r1"), "r1"), b.replica_id, None)
    for k in range(20):  # its prefix is there, and it has nothing in flight
        choice = await router.choose_replicas([a, b], _pending(_request(f"r{k + 2}"), f"r{k + 2}"))
        assert _names(choice) == [{"a"}]
    # where no replica takes requests, each may answer (a 503 at once)
    a.routing_stats["engine_up"] = False
    choice = await router.choose_replicas([a, b], _pending(_request("last"), "last"))
    assert set().union(*_names(choice)) == {"a", "b"}


async def test_a_channel_goes_to_the_replica_it_names_or_where_that_is_gone_to_a_live_one() -> None:
    router, a, b = _router(), Replica("a"), Replica("b")
    named = await router.choose_replicas([a, b], _pending(ChannelOpen("b", "ingress"), "c1"))
    assert _names(named) == [{"b"}]
    # never an empty choice: Serve would retry it for as long as the call lives, in one of its
    # few routing tasks, cancelled or not (the replica it reaches ends it at once)
    gone = await router.choose_replicas([a, b], _pending(ChannelOpen("c", "ingress"), "c2"))
    assert _names(gone) == [{"a", "b"}]
