"""The prefix-aware request router's choices, called as Serve calls it (no Ray): a request goes to
the replica holding its prefix, never to one whose engine core is down while another takes
requests; a channel goes to the replica it names, and to a live one where that one is gone; the
router's per-request state ends with the request however it ends (routed, rejected, cancelled
while queued), not only when it is routed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from replicas.channel import ChannelOpen
from replicas.request import GenerateRequest, SamplingParams
from replicas.router import BLOCK, PrefixAffinityRouter, block_keys

DEPLOYMENT = DeploymentID(name="LLMReplica-m", app_name="shardserve")
PROMPT = tuple(range(4 * BLOCK))


@dataclass
class Replica:
    """What the router reads of Serve's RunningReplica."""

    name: str
    routing_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def replica_id(self) -> ReplicaID:
        return ReplicaID(unique_id=self.name, deployment_id=DEPLOYMENT)


def _router() -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(deployment_id=DEPLOYMENT,
                                  handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(imbalance=8)
    return router


def _pending(rid: str, arg: Any = None) -> PendingRequest:
    arg = GenerateRequest(rid, PROMPT, SamplingParams(max_tokens=4)) if arg is None else arg
    return PendingRequest(args=[arg], kwargs={},
                          metadata=RequestMetadata(request_id=rid, internal_request_id=rid))


def _names(choice: list[list[Replica]]) -> list[set[str]]:
    return [{r.name for r in rank} for rank in choice]


async def test_a_request_follows_its_prefix_to_the_replica_that_holds_it() -> None:
    router, a, b = _router(), Replica("a"), Replica("b")
    router.on_request_routed(_pending("r1"), b.replica_id, None)
    router.on_request_completed(b.replica_id, "r1")
    assert _names(await router.choose_replicas([a, b], _pending("r2"))) == [{"b"}, {"a"}]


async def test_a_replica_whose_engine_is_down_gets_no_requests_while_another_takes_them() -> None:
    router, a, b = _router(), Replica("a"), Replica("b", {"engine_up": False})
    router.on_request_routed(_pending("r1"), b.replica_id, None)
    for k in range(20):  # its prefix is there, and it has nothing in flight
        assert _names(await router.choose_replicas([a, b], _pending(f"r{k + 2}"))) == [{"a"}]
    # where no replica takes requests, each may answer (a 503 at once)
    a.routing_stats["engine_up"] = False
    choice = await router.choose_replicas([a, b], _pending("last"))
    assert set().union(*_names(choice)) == {"a", "b"}


async def test_a_channel_goes_to_the_replica_it_names_or_where_that_is_gone_to_a_live_one() -> None:
    router, a, b = _router(), Replica("a"), Replica("b")
    named = await router.choose_replicas([a, b], _pending("c1", ChannelOpen("b", "ingress")))
    assert _names(named) == [{"b"}]
    # never an empty choice: Serve would retry it for as long as the call lives, in one of its
    # few routing tasks, cancelled or not (the replica it reaches ends it at once)
    gone = await router.choose_replicas([a, b], _pending("c2", ChannelOpen("c", "ingress")))
    assert _names(gone) == [{"a", "b"}]


async def test_pending_keys_end_with_the_request_however_it_ends() -> None:
    router, replica = _router(), Replica("a")
    routed, rejected, cancelled = (_pending(rid) for rid in ("routed", "rejected", "cancelled"))
    for p in (routed, rejected, cancelled):
        await router.choose_replicas([replica], p)
    keys = router.pending["routed"].keys
    await router.choose_replicas([replica], routed)  # a backoff round reuses the keys
    assert router.pending["routed"].keys is keys
    assert set(router.pending) == {"routed", "rejected", "cancelled"}

    routed.future.set_result(replica)
    await asyncio.sleep(0)  # run the future's callbacks: a resolved one keeps its keys
    router.on_request_routed(routed, replica.replica_id, None)
    assert "routed" not in router.pending
    assert router._match(replica.replica_id, block_keys(routed.args[0])) == 4

    rejected.future.set_result(replica)  # dispatched, refused by the replica
    router.on_request_completed(replica.replica_id, "rejected")
    assert "rejected" not in router.pending

    cancelled.future.cancel()  # the caller gave up while queued: neither hook comes
    await asyncio.sleep(0)
    assert router.pending == {}


async def test_a_retried_request_is_still_forgotten_when_cancelled() -> None:
    router, replica = _router(), Replica("a")
    pending = _pending("r")
    await router.choose_replicas([replica], pending)
    pending.future.set_result(replica)
    pending.reset_future()  # Serve's retry after a rejection, before its completion arrives
    await router.choose_replicas([replica], pending)
    await asyncio.sleep(0)
    assert router.pending["r"].future is pending.future
    pending.future.cancel()
    await asyncio.sleep(0)
    assert router.pending == {}


async def test_requests_without_a_prompt_leave_nothing() -> None:
    router, replica = _router(), Replica("a")
    assert _names(await router.choose_replicas([replica], _pending("x", "not a request"))) == [
        {"a"}]
    assert router.pending == {}
