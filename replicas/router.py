"""Prefix-aware routing of requests to model replicas, on Ray Serve's request-router extension point.

Runs inside each caller of the model deployment (the ingress). It remembers, per replica, the
chained keys of the 16-token prompt blocks it recently sent there, made by the same function as
the replica's own prefix cache (replicas/block_hash.py). A request goes to the replica holding
its longest known prefix unless that replica has more than `imbalance` requests in flight beyond
the least loaded one; otherwise (and when nothing matches) it falls back to the least loaded of two
random replicas.

Per-request state is keyed by Serve's internal request id and ends with the request: a request's
keys, made once in `choose_replicas` (which runs again on every backoff round), leave when it is
routed, when it completes (Serve calls that for every dispatched request, rejected ones too) or
when its routing future is cancelled (a request cancelled while queued reaches neither hook).

A replica whose engine core is down (restarting, or given up until Serve replaces the replica)
fails each request at once, so least-loaded routing would send it the most; one whose core has
gone silent (frozen, until its replica kills it) holds each request until then: while another
replica takes requests, neither gets any. Each replica says so in its routing stats
(`record_routing_stats`, polled by Serve's controller every `STATS_PERIOD_S` and sent to the
routers when it changes).

A channel call (replicas/channel.py) is not a request: it goes to the one replica it names (or,
where that one is gone, to any: there it ends at once)."""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import TypeVar

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from replicas.block_hash import BlockKey, media_key_tokens, prefix_keys
from replicas.channel import ChannelOpen
from replicas.request import GenerateRequest

BLOCK = 16
MAX_BLOCKS = 64  # look at most this far into a prompt
MAX_ENTRIES = 200_000  # remembered block keys per replica
MAX_PENDING = 10_000  # requests being routed; a backstop, each also leaves with its request
STATS_PERIOD_S = 1.0  # how often Serve's controller asks each replica for its routing stats

T = TypeVar("T")


def block_keys(request: GenerateRequest) -> list[BlockKey]:
    tokens = request.prompt_token_ids
    if request.mm_items:
        tokens = media_key_tokens(tokens, request.mm_items)
    return prefix_keys(tokens, BLOCK, request.cache_salt, MAX_BLOCKS)


def taking_requests(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """The replicas whose engine core takes requests; all of them where none does (each then
    answers 503 at once, which is right)."""
    up = [r for r in replicas if r.routing_stats.get("engine_up", True)]
    return up or replicas


@dataclass(frozen=True)
class _Pending:
    keys: list[BlockKey]
    future: asyncio.Future  # the routing attempt watched for cancellation (a retry makes a new one)


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 8) -> None:
        self.imbalance = imbalance
        self.prefixes: dict[ReplicaID, OrderedDict[BlockKey, None]] = {}
        self.inflight: dict[ReplicaID, int] = {}
        self.pending: OrderedDict[str, _Pending] = OrderedDict()  # by internal request id

    @staticmethod
    def _arg(pending: PendingRequest | None, kind: type[T]) -> T | None:
        """The call's argument of this type (a request, or a channel's opening)."""
        if pending is None:
            return None
        for arg in pending.args:
            if isinstance(arg, kind):
                return arg
        return None

    def _match(self, replica: ReplicaID, keys: list[BlockKey]) -> int:
        known = self.prefixes.get(replica)
        if not known:
            return 0
        n = 0
        for k in keys:  # chained keys: the first miss ends the shared prefix
            if k not in known:
                break
            n += 1
        return n

    def _keys(self, pending: PendingRequest, request: GenerateRequest) -> list[BlockKey]:
        rid = pending.metadata.internal_request_id
        entry = self.pending.get(rid)
        if entry is not None and entry.future is pending.future:
            return entry.keys
        keys = entry.keys if entry is not None else block_keys(request)
        self.pending[rid] = _Pending(keys, pending.future)
        self.pending.move_to_end(rid)
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)
        pending.future.add_done_callback(lambda future: self._forget_cancelled(rid, future))
        return keys

    def _forget_cancelled(self, rid: str, future: asyncio.Future) -> None:
        entry = self.pending.get(rid)
        if future.cancelled() and entry is not None and entry.future is future:
            del self.pending[rid]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        opening = self._arg(pending_request, ChannelOpen)
        if opening is not None:
            # a channel goes to the replica it names; where that one is gone, to any other,
            # which ends the call at once (LLMServer.channel). Never nowhere: Serve retries an
            # unroutable call for as long as it lives, even cancelled, and each such call holds
            # one of the router's 2-per-replica routing tasks; two channels to replaced
            # replicas left no task to route any request
            named = [r for r in candidate_replicas if r.replica_id.unique_id == opening.replica]
            return [named or candidate_replicas]
        request = self._arg(pending_request, GenerateRequest)
        candidate_replicas = taking_requests(candidate_replicas)
        load = {r.replica_id: self.inflight.get(r.replica_id, 0) for r in candidate_replicas}
        least = min(load.values())
        if request is not None:
            keys = self._keys(pending_request, request)
            best = max(candidate_replicas, key=lambda r: (self._match(r.replica_id, keys),
                                                          -load[r.replica_id]))
            if (self._match(best.replica_id, keys) > 0
                    and load[best.replica_id] <= least + self.imbalance):
                rest = sorted((r for r in candidate_replicas if r is not best),
                              key=lambda r: load[r.replica_id])
                return [[best], rest] if rest else [[best]]
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        return [sorted(two, key=lambda r: load[r.replica_id])]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: object) -> None:
        self.inflight[replica_id] = self.inflight.get(replica_id, 0) + 1
        entry = self.pending.pop(pending_request.metadata.internal_request_id, None)
        if entry is not None:
            keys = entry.keys
        else:
            request = self._arg(pending_request, GenerateRequest)
            keys = block_keys(request) if request is not None else []
        known = self.prefixes.setdefault(replica_id, OrderedDict())
        for k in keys:
            known[k] = None
            known.move_to_end(k)
        while len(known) > MAX_ENTRIES:
            known.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.pending.pop(internal_request_id, None)
        if self.inflight.get(replica_id, 0) > 0:
            self.inflight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.prefixes.pop(replica_id, None)
        self.inflight.pop(replica_id, None)
