"""LLMReplica: the Ray Serve deployment that serves one model: a thin front to its engine core.

The engine core (replicas/engine_core.py) computes in a process of its own; the replica starts and
supervises it (replicas/core_client.py) and fans its step messages out to the `generate` calls.
`generate` is a streaming method: the ingress calls it once per request through a DeploymentHandle
with `stream=True` and receives tuples of `TokenBatch`es, coalesced per choice. Under load a
request's tokens are grouped (`stream_messages_per_s`, `stream_interval`), so one Ray hop carries
several of them. A cancelled call (the client went away) aborts the request and frees its KV
blocks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, replace

import ray
from ray import serve

from replicas import status_board
from replicas.core_client import InProcessCore, ProcessCore
from replicas.engine_core import CoreSpec, ReplicaConfig
from replicas.request import GenerateRequest, TokenBatch

__all__ = ["LLMReplica", "LLMServer", "ReplicaConfig"]

logger = logging.getLogger(__name__)


def _serve_context() -> tuple[str | None, dict]:
    """Names shard actors after their Serve replica, and tells a core at tp > 1 how to reach
    Ray and the replica's placement group (its shards take bundles 1..N)."""
    try:
        ctx = serve.get_replica_context()
    except Exception:  # not inside a Serve replica
        return None, {}
    if ctx is None:
        return None, {}
    runtime = ray.get_runtime_context()
    pg = ray.util.get_current_placement_group()
    return ctx.replica_id.unique_id, {
        "ray_address": runtime.gcs_address, "ray_namespace": runtime.namespace,
        "runtime_env": runtime.runtime_env or None,
        "placement_group_id": pg.id.binary() if pg is not None else None,
        "shard_name_prefix": f"shard-{ctx.replica_id.unique_id}"}


def _coalesce(items: list[TokenBatch]) -> tuple[TokenBatch, ...]:
    merged: dict[int, TokenBatch] = {}
    for b in items:
        prev = merged.get(b.choice_index)
        if prev is None:
            merged[b.choice_index] = b
            continue
        lps = None if prev.logprobs is None else prev.logprobs + (b.logprobs or ())
        merged[b.choice_index] = TokenBatch(
            b.choice_index, prev.token_ids + b.token_ids, lps, b.finish_reason, b.stop_reason,
            prev.num_prompt_tokens, prev.num_cached_tokens,
            prev.prompt_logprobs if prev.prompt_logprobs is not None else b.prompt_logprobs,
            accepted_prediction_tokens=(prev.accepted_prediction_tokens
                                        + b.accepted_prediction_tokens),
            rejected_prediction_tokens=(prev.rejected_prediction_tokens
                                        + b.rejected_prediction_tokens))
    return tuple(merged.values())


class LLMServer:
    """The replica's logic, usable without Serve (tests, `bench engine`). `in_process`: the
    engine core runs on the caller's event loop instead of in a process of its own (the engine
    alone, as `bench engine` measures it)."""

    def __init__(self, config: ReplicaConfig, replica_id: str | None = None, name: str = "",
                 in_process: bool = False, ray_context: dict | None = None) -> None:
        self.config = config
        # named on each request's first batch, so the ingress can address stop_choice here
        self.replica_id = replica_id
        spec = CoreSpec(config, name or config.model, **(ray_context or {}))
        self.core: InProcessCore | ProcessCore = (InProcessCore if in_process
                                                  else ProcessCore)(spec)
        info = self.core.info
        self.stream_budget = (config.stream_messages_per_s
                              if config.stream_messages_per_s is not None
                              else 500.0 if info["on_gpu"] else 50.0)
        # by default on CPUs a request alone still waits 40 ms between messages (25 a second,
        # below what a reader sees): each message costs ~2 ms of the replica's CPU and more in
        # the ingress, taken from the engine's cores; one stream's TPOT 10.8 -> 9.3 ms
        self.stream_floor_s = (0.04 if config.stream_messages_per_s is None
                               and not info["on_gpu"] else 0.0)
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.stream_messages = 0  # generate's yields: each is one Ray message to the ingress

    async def generate(self, request: GenerateRequest) -> AsyncIterator[tuple[TokenBatch, ...]]:
        outbox = self.core.add(request)
        outbox.min_tokens = self.config.stream_interval
        budget = self.stream_budget
        remaining = request.n
        first = True
        try:
            while remaining:
                items = await outbox.take()
                for item in items:
                    if isinstance(item, BaseException):
                        remaining = 0  # the core has let the request go
                        raise item
                batches = _coalesce(items)  # type: ignore[arg-type]
                if first and batches and self.replica_id is not None:
                    batches = (replace(batches[0], replica=self.replica_id), *batches[1:])
                first = False
                remaining -= sum(b.finish_reason is not None for b in batches)
                if budget:
                    outbox.hold_until = time.monotonic() + max(
                        self.core.streams.producing / budget, self.stream_floor_s)
                self.stream_messages += 1
                yield batches
        finally:
            if remaining:  # cancelled, or the consumer stopped early (a stop string)
                self.core.abort(request.request_id)
            else:
                self.core.streams.close(request.request_id)

    def stop_choice(self, request_id: str, choice: int, kept: int) -> None:
        self.core.stop_choice(request_id, choice, kept)

    def info(self) -> dict:
        return {**self.core.info, "config": asdict(self.config)}

    def stats(self) -> dict:
        return {**self.core.stats(), "stream_messages": self.stream_messages}

    async def fresh_stats(self) -> dict:
        return await self.core.fresh_stats()

    def close(self) -> None:
        self.core.close()


@serve.deployment(max_ongoing_requests=256, health_check_period_s=10, health_check_timeout_s=60)
class LLMReplica:
    def __init__(self, config: ReplicaConfig, model_name: str) -> None:
        ctx = serve.get_replica_context()
        replica, ray_context = _serve_context()
        self.server = LLMServer(config, replica, model_name, ray_context=ray_context)
        loop = asyncio.get_running_loop()
        # the engine's state, for /health and /metrics, on a path of its own (no request slot);
        # and the ingresses' stop_choice messages on the same board
        self._reporter = loop.create_task(status_board.publish_forever(
            ctx.app_name, model_name, replica, self.server.stats))
        self._stops = loop.create_task(status_board.take_stops_forever(
            ctx.app_name, replica, self.server.stop_choice))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[tuple[TokenBatch, ...]]:
        async with contextlib.aclosing(self.server.generate(request)) as stream:
            async for batches in stream:
                yield batches

    async def info(self) -> dict:
        return self.server.info()

    async def stats(self) -> dict:
        return self.server.stats()

    def check_health(self) -> None:
        """Serve replaces the replica when this raises: its engine core kept failing and the
        front gave up restarting it (a core that died once is restarted in place)."""
        why = self.server.core.failure()
        if why is not None:
            raise RuntimeError(f"engine core failed: {why}")

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.close()
