"""Prefix-aware routing of requests to model replicas, on Ray Serve's request-router extension point.

Runs inside each caller of the model deployment (the ingress). It remembers, per replica, the
chained hashes of the 16-token prompt blocks it recently sent there, salted like the replica's
own prefix cache. A request goes to the replica holding its longest known prefix unless that
replica has more than `imbalance` requests in flight beyond the least loaded one; otherwise (and
when nothing matches) it falls back to the least loaded of two random replicas."""

from __future__ import annotations

import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from replicas.request import GenerateRequest

BLOCK = 16
MAX_BLOCKS = 64  # look at most this far into a prompt
MAX_ENTRIES = 200_000  # remembered block hashes per replica


def block_hashes(request: GenerateRequest) -> list[int]:
    ids = request.prompt_token_ids
    out: list[int] = []
    prev: int | None = None
    for i in range(min(len(ids) // BLOCK, MAX_BLOCKS)):
        prev = hash((prev, request.cache_salt, ids[i * BLOCK:(i + 1) * BLOCK]))
        out.append(prev)
    return out


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 8) -> None:
        self.imbalance = imbalance
        self.prefixes: dict[ReplicaID, OrderedDict[int, None]] = {}
        self.inflight: dict[ReplicaID, int] = {}
        self.pending_hashes: dict[int, list[int]] = {}

    @staticmethod
    def _request(pending: PendingRequest | None) -> GenerateRequest | None:
        if pending is None:
            return None
        for arg in pending.args:
            if isinstance(arg, GenerateRequest):
                return arg
        return None

    def _match(self, replica: ReplicaID, hashes: list[int]) -> int:
        known = self.prefixes.get(replica)
        if not known:
            return 0
        n = 0
        for h in hashes:  # chained hashes: the first miss ends the shared prefix
            if h not in known:
                break
            n += 1
        return n

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = self._request(pending_request)
        load = {r.replica_id: self.inflight.get(r.replica_id, 0) for r in candidate_replicas}
        least = min(load.values())
        if request is not None:
            hashes = block_hashes(request)
            self.pending_hashes[id(pending_request)] = hashes
            best = max(candidate_replicas, key=lambda r: (self._match(r.replica_id, hashes),
                                                          -load[r.replica_id]))
            if (self._match(best.replica_id, hashes) > 0
                    and load[best.replica_id] <= least + self.imbalance):
                rest = sorted((r for r in candidate_replicas if r is not best),
                              key=lambda r: load[r.replica_id])
                return [[best], rest] if rest else [[best]]
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        return [sorted(two, key=lambda r: load[r.replica_id])]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: object) -> None:
        self.inflight[replica_id] = self.inflight.get(replica_id, 0) + 1
        hashes = self.pending_hashes.pop(id(pending_request), None)
        if hashes is None:
            request = self._request(pending_request)
            hashes = block_hashes(request) if request is not None else []
        known = self.prefixes.setdefault(replica_id, OrderedDict())
        for h in hashes:
            known[h] = None
            known.move_to_end(h)
        while len(known) > MAX_ENTRIES:
            known.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.inflight.get(replica_id, 0) > 0:
            self.inflight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.prefixes.pop(replica_id, None)
        self.inflight.pop(replica_id, None)
