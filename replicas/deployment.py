"""LLMReplica: the Ray Serve deployment that serves one model: a thin front to its engine core.

The engine core (replicas/engine_core.py) computes in a process of its own; the replica starts and
supervises it (replicas/core_client.py) and fans its step messages out to the `generate` calls.
`generate` is a streaming method: the ingress calls it once per request through a DeploymentHandle
with `stream=True`. Where the ingress has a channel open here (`channel`, replicas/channel.py) the
request's batches go over it, one message per engine step for all of that ingress's requests, and
`generate` only marks the request channeled and carries its failure; elsewhere it yields tuples of
`TokenBatch`es itself, coalesced per choice. The ingress groups tokens into SSE events (the stream
interval, the message budget this replica reports). A cancelled call (the client went away)
aborts the request and frees its KV blocks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict, replace

import ray
from ray import serve

from replicas import core_protocol as proto
from replicas import status_board
from replicas.channel import (
    IDLE_S,
    OPEN_WAIT_S,
    Channel,
    Channeled,
    ChannelOpen,
    NeedChannel,
    node_id,
)
from replicas.core_client import InProcessCore, ProcessCore
from replicas.replica_config import CoreSpec, ReplicaConfig
from replicas.request import EngineError, GenerateRequest, TokenBatch, coalesce

__all__ = ["LLMReplica", "LLMServer", "ReplicaConfig"]

logger = logging.getLogger(__name__)


def _serve_context() -> tuple[str | None, dict]:
    """Names shard actors after their Serve replica, and tells a core at tp > 1 how to reach
    Ray and the replica's placement group (ranks 1..N-1 take bundles 1..N-1)."""
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
        # the message budget the ingresses apply to their streams of this model (0: none),
        # and the least wait between two of one request's messages (serve_app/channels.py)
        self.stream_budget, self.stream_floor_s = info["stream_pace"]
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.stream_messages = 0  # yields of generate and channels: Ray messages to the ingress
        self.channels: dict[str, Channel] = {}  # by ingress replica
        self._opened: dict[str, asyncio.Event] = {}  # set when that ingress's channel opens
        self.channeled_requests = 0

    async def channel(self, open_: ChannelOpen) -> AsyncIterator[bytes]:
        """The channel of the ingress `open_.ingress`: an empty message at once (it is open),
        then its channeled requests' rows, one message per wake-up (an engine step's outputs
        while the ingress keeps up, a floor's under a floor; `replicas.channel.decode` reads
        them), until it has been idle for IDLE_S. A second open from the same ingress (it lost
        the first) replaces the first. An open that names another replica (it is gone, and the
        router sent its channel here: replicas/router.py) ends at once, before that message."""
        if self.replica_id is not None and open_.replica != self.replica_id:
            return
        old = self.channels.pop(open_.ingress, None)
        if old is not None:
            self._close_channel(old, open_.ingress)
        # direct where the ingress's socket is on this node and the core is a process of its own
        direct = (open_.address is not None and open_.node is not None
                  and open_.node == node_id() and isinstance(self.core, ProcessCore))
        channel = self.channels[open_.ingress] = Channel(direct)
        if direct:
            self.core.connect_ingress(open_.ingress, open_.address)
        opened = self._opened.pop(open_.ingress, None)
        if opened is not None:
            opened.set()
        try:
            yield proto.encode([])
            while not channel.closed:
                message = await channel.take(IDLE_S)
                if message is None:
                    if any(box.channel is channel for box in self.core.streams.outboxes.values()):
                        continue
                    break  # idle: see replicas/channel.py
                self.stream_messages += 1
                yield message
        finally:
            if self.channels.get(open_.ingress) is channel:
                del self.channels[open_.ingress]
            self._close_channel(channel, open_.ingress)

    def _close_channel(self, channel: Channel, ingress: str) -> None:
        """Its requests are aborted and fail (their ingress can no longer get their tokens)."""
        if channel.direct and not channel.closed:
            self.core.disconnect_ingress(ingress)
        channel.close()
        for rid, box in list(self.core.streams.outboxes.items()):
            if box.channel is channel:
                self.core.abort(rid)
                box.put(EngineError("the stream of this request's tokens to the ingress broke",
                                    status=503, type_="ServiceUnavailableError"))

    async def generate(self, request: GenerateRequest, channel: str | None = None
                       ) -> AsyncIterator[tuple[TokenBatch, ...] | Channeled | NeedChannel]:
        """The request's batches; or, given its ingress (`channel`) and once that ingress's
        channel is open here (asked for by a `NeedChannel`, waited for up to OPEN_WAIT_S), one
        `Channeled` and then nothing until the request ends (its batches go over the channel)."""
        if channel is not None and channel not in self.channels and self.replica_id is not None:
            yield NeedChannel(self.replica_id)
            opened = self._opened.setdefault(channel, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(OPEN_WAIT_S):
                    await opened.wait()
        channeled = self.channels.get(channel) if channel is not None else None
        if channeled is not None and channeled.direct:
            request = replace(request, ingress=channel)
        outbox = self.core.add(request)
        outbox.channel = channeled
        remaining = request.n
        first = True
        try:
            if outbox.channel is not None:
                self.channeled_requests += 1
                yield Channeled(self.replica_id)
            while remaining:
                items = await outbox.take()
                for item in items:
                    if isinstance(item, BaseException):
                        remaining = 0  # the core has let the request go
                        raise item
                batches = coalesce(items)  # type: ignore[arg-type]
                remaining -= sum(b.finish_reason is not None for b in batches)
                if outbox.channel is not None:
                    continue  # only each choice's last batch comes here: the channel sent it
                if first and batches and self.replica_id is not None:
                    batches = (batches[0]._replace(replica=self.replica_id), *batches[1:])
                first = False
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
        return {**self.core.stats(), "stream_messages": self.stream_messages,
                "channeled_requests": self.channeled_requests,
                "stream_messages_per_s": self.stream_budget,
                "stream_floor_s": self.stream_floor_s}

    async def fresh_stats(self) -> dict:
        return await self.core.fresh_stats()

    def engine_up(self) -> bool:
        """Whether the engine core takes requests now: not down, restarting or given up, nor
        silent for seconds (a frozen process, until the monitor kills it)."""
        return self.core.taking_requests()

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

    async def generate(self, request: GenerateRequest, channel: str | None = None
                       ) -> AsyncIterator[tuple[TokenBatch, ...] | Channeled | NeedChannel
                                          | EngineError]:
        """LLMServer.generate's items, and its failure (a 4xx/5xx the ingress renders) as the
        last item instead of raised: Serve logs each exception a call raises with its traceback,
        ~30 lines, and a core restarting under load fails thousands of requests with 503 (a
        chaos run wrote 670,000 lines in 10 minutes)."""
        async with contextlib.aclosing(self.server.generate(request, channel)) as stream:
            try:
                async for batches in stream:
                    yield batches
            except EngineError as exc:
                yield exc

    async def channel(self, open_: ChannelOpen) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(self.server.channel(open_)) as stream:
            async for message in stream:
                yield message

    async def info(self) -> dict:
        return self.server.info()

    async def stats(self) -> dict:
        return self.server.stats()

    def record_routing_stats(self) -> dict[str, bool]:
        """What every caller's router reads of this replica (replicas/router.py)."""
        return {"engine_up": self.server.engine_up()}

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
