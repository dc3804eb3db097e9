"""The engine's bounds (no Ray): a full waiting queue and a missed queue-wait deadline are 503s
with Retry-After that free everything; health tells a live loop from a dead one."""

from __future__ import annotations

import asyncio
import time

import pytest

from replicas.deployment import LLMServer, ReplicaConfig
from replicas.embedded import EMBEDDED_MODEL_ID
from replicas.request import EngineError, GenerateRequest, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def server() -> LLMServer:
    # the engine on this loop (its bookkeeping is read directly here)
    server = LLMServer(ReplicaConfig(model=EMBEDDED_MODEL_ID, max_model_len=256,
                                     kv_cache_gib=0.05, max_num_seqs=2,
                                     max_num_batched_tokens=64, max_waiting=3), in_process=True)
    yield server
    server.close()


def _request(i: int, max_tokens: int = 40, deadline: float | None = None) -> GenerateRequest:
    return GenerateRequest(f"a{i}-{time.monotonic_ns()}", tuple(range(20, 40)),
                           SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                          ignore_eos=True), deadline=deadline)


async def _drain(server: LLMServer, req: GenerateRequest) -> str | EngineError:
    try:
        async for batches in server.generate(req):
            for b in batches:
                if b.finish_reason is not None:
                    return b.finish_reason
    except EngineError as exc:
        return exc
    return "no finish"


async def test_a_full_queue_is_a_503_with_retry_after(server: LLMServer) -> None:
    before = server.core.engine.stats.rejected_queue_full
    # all 8 arrive before a step: 3 fit the waiting queue, the rest are refused at once
    results = await asyncio.gather(*(_drain(server, _request(i)) for i in range(8)))
    refused = [r for r in results if isinstance(r, EngineError)]
    assert len(refused) == 5 and results.count("length") == 3
    for r in refused:
        assert r.status == 503 and r.retry_after is not None and "overloaded" in r.message
    assert server.core.engine.stats.rejected_queue_full - before == 5
    assert server.core.engine.blocks.num_used_blocks == 0


async def test_a_request_not_scheduled_by_its_deadline_is_a_503(server: LLMServer) -> None:
    before = server.core.engine.stats.rejected_queue_wait
    # two long requests hold both slots; the third waits past its 0.05 s deadline
    long = [asyncio.ensure_future(_drain(server, _request(i, max_tokens=230))) for i in range(2)]
    await asyncio.sleep(0.01)
    started = time.monotonic()
    late = await _drain(server, _request(9, deadline=time.time() + 0.05))
    assert isinstance(late, EngineError) and late.status == 503, late
    assert "queue-wait" in late.message and late.retry_after is not None
    assert time.monotonic() - started < 2.0
    assert server.core.engine.stats.rejected_queue_wait - before == 1
    # one with room left to wait is served
    assert await _drain(server, _request(10, max_tokens=5, deadline=time.time() + 60)) == "length"
    assert await asyncio.gather(*long) == ["length", "length"]
    assert server.core.engine.num_waiting == 0 and server.core.engine.blocks.num_used_blocks == 0
    assert not server.core.engine._deadlines


async def test_the_deadline_is_kept_only_until_scheduling(server: LLMServer) -> None:
    # scheduled at once, then runs far past its deadline: a deadline bounds the wait, not the
    # generation
    req = _request(11, max_tokens=60, deadline=time.time() + 0.05)
    assert await _drain(server, req) == "length"


async def test_health_reports_the_loop(server: LLMServer) -> None:
    await _drain(server, _request(12, max_tokens=2))
    health = server.core.engine.health()
    assert health["failed"] is None and health["loop_alive"] and not health["stalled"]
    stats = server.stats()
    assert stats["loop_alive"] and stats["max_model_len"] == 256
    assert {"rejected_queue_full", "rejected_queue_wait"} <= set(stats)
