"""Block keys: unambiguous over salt, parent and tokens, chained into prefix keys; the router keys
blocks with the cache's own function; the router's per-request state ends with the request however
it ends (routed, rejected, cancelled while queued), not only when it is routed."""

from __future__ import annotations

import asyncio

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from replicas.block_hash import block_key, prefix_keys
from replicas.kv_cache import BlockManager
from replicas.request import GenerateRequest, SamplingParams, Sequence
from replicas.router import BLOCK, PrefixAffinityRouter, block_keys

DEPLOYMENT = DeploymentID(name="model", app_name="app")


def test_keys_are_unambiguous() -> None:
    root = block_key(None, [1], None)
    keys = [block_key(None, [1, 2], None), block_key(None, [1, 2], ""),
            block_key(None, [1, 2], "\x00"), block_key(None, [1, 2], "\x01"),
            block_key(None, [1, 2, 0], None), block_key(None, [258], None),
            block_key(None, [1, 2 + 2**32], None), block_key(root, [2], None),
            block_key(root, [2], ""), block_key(None, [2], "\x01" + "\x00" * 16)]
    assert len(set(keys)) == len(keys)
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert block_key(None, (1, 2), "s") == block_key(None, [1, 2], "s")  # tuples and lists alike


def test_prefix_keys_chain_block_keys() -> None:
    ids = list(range(40))
    chain = prefix_keys(ids, 16, "s")
    assert chain == [block_key(None, ids[:16], "s"), block_key(chain[0], ids[16:32], "s")]
    assert prefix_keys(tuple(ids), 16, "s") == chain
    assert prefix_keys(ids, 16, "s", max_blocks=1) == chain[:1]
    assert prefix_keys(ids[:15], 16, "s") == []
    assert prefix_keys(ids, 16, None) != chain


def test_the_router_keys_blocks_as_the_cache_does() -> None:
    ids = tuple(range(3, 3 + 3 * BLOCK + 5))
    request = GenerateRequest("r", ids, SamplingParams(max_tokens=1), cache_salt="t")
    blocks = BlockManager(num_blocks=16, block_size=BLOCK)
    seq = Sequence(0, "r", 0, list(ids), len(ids), SamplingParams(max_tokens=1), cache_salt="t")
    assert blocks.allocate(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    blocks.commit_full_blocks(seq, 0)
    assert block_keys(request) == [blocks.blocks[b].key for b in seq.block_table[:3]]


def _router() -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(deployment_id=DEPLOYMENT,
                                  handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    return router


class _Replica:
    """What choose_replicas reads of a RunningReplica."""

    def __init__(self, name: str) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)


def _pending(rid: str, prompt: tuple[int, ...]) -> PendingRequest:
    request = GenerateRequest(rid, prompt, SamplingParams(max_tokens=1))
    return PendingRequest(args=[request], kwargs={},
                          metadata=RequestMetadata(request_id=rid, internal_request_id=rid))


def test_pending_keys_end_with_the_request_however_it_ends() -> None:
    async def scenario() -> None:
        router, replica = _router(), _Replica("a")
        prompt = tuple(range(40))
        routed, rejected, cancelled = (_pending(rid, prompt)
                                       for rid in ("routed", "rejected", "cancelled"))
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
        assert router._match(replica.replica_id, block_keys(routed.args[0])) == 2

        rejected.future.set_result(replica)  # dispatched, refused by the replica
        router.on_request_completed(replica.replica_id, "rejected")
        assert "rejected" not in router.pending

        cancelled.future.cancel()  # the caller gave up while queued: neither hook comes
        await asyncio.sleep(0)
        assert router.pending == {}

    asyncio.run(scenario())


def test_a_retried_request_is_still_forgotten_when_cancelled() -> None:
    async def scenario() -> None:
        router, replica = _router(), _Replica("a")
        pending = _pending("r", tuple(range(40)))
        await router.choose_replicas([replica], pending)
        first = pending.future
        first.set_result(replica)
        pending.reset_future()  # Serve's retry after a rejection, before its completion arrives
        await router.choose_replicas([replica], pending)
        await asyncio.sleep(0)
        assert router.pending["r"].future is pending.future
        pending.future.cancel()
        await asyncio.sleep(0)
        assert router.pending == {}

    asyncio.run(scenario())


def test_requests_without_a_prompt_leave_nothing() -> None:
    async def scenario() -> None:
        router, replica = _router(), _Replica("a")
        pending = PendingRequest(args=["not a GenerateRequest"], kwargs={},
                                 metadata=RequestMetadata(request_id="x", internal_request_id="x"))
        assert await router.choose_replicas([replica], pending) == [[replica]]
        assert router.pending == {}

    asyncio.run(scenario())
