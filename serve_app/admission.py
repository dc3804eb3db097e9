"""Admission control in the ingress: how many generation requests it lets through to each model,
and to each API key, before it answers 503 (or 429) at once instead of queueing.

Every queue between a client and the engine is bounded: this ingress admits at most what the
model's replicas can hold (each replica's Serve `max_ongoing_requests` plus its router queue
`max_queued_requests`, shared among the ingress replicas); the router queue and the engine's
waiting queue are bounded by Serve and the engine; and every admitted request carries a deadline
by which the engine must have scheduled it (`max_queue_wait_s`). A refusal costs microseconds,
so a burst is shed while /health and the admitted streams keep their pace.

Also owns the rejection counts by reason that /metrics exports."""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

from serve_app.config import AppConfig
from serve_app.errors import APIError

RETRY_AFTER_S = 1

# reasons a request was turned away, as /metrics labels them
OVERLOADED = "overloaded"  # this ingress already holds the model's capacity
PER_KEY_LIMIT = "per_key_limit"
ROUTER_QUEUE_FULL = "router_queue_full"  # Serve's router queue (BackPressureError)
QUEUE_WAIT = "queue_wait"  # no first output by the deadline (the engine counts its own expiries)
REPLICA_UNAVAILABLE = "replica_unavailable"
DRAINING = "draining"  # the server is stopping


def model_limits(config: AppConfig) -> dict[str, int]:
    """Generation requests one ingress replica admits per model."""
    out = {}
    for m in config.models:
        capacity = m.max_replicas * (m.replica_max_ongoing_requests
                                     + m.replica_max_queued_requests)
        out[m.name] = max(1, capacity // config.ingress_num_replicas)
    return out


@dataclass
class Ticket:
    """One admitted request; `release` (idempotent) gives its place back."""

    admission: "Admission"
    model: str
    key: str | None
    # time.time() by which the engine must schedule it (GenerateRequest.deadline)
    deadline: float = field(default_factory=time.time)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission._release(self)


class Admission:
    def __init__(self, config: AppConfig) -> None:
        self.limits = model_limits(config)
        self.per_key = config.max_requests_per_key
        self.max_queue_wait_s = config.max_queue_wait_s
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.by_key: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[tuple[str, str]] = collections.Counter()
        # release may run from a finalizer on another thread
        self._lock = threading.Lock()

    def admit(self, model: str, key: str | None) -> Ticket:
        with self._lock:
            if self.in_flight[model] >= self.limits[model]:
                self.rejected[model, OVERLOADED] += 1
                raise APIError(
                    f"the server is overloaded: {self.limits[model]} requests to this model "
                    "are in flight; retry later", 503, retry_after=RETRY_AFTER_S)
            if self.per_key is not None and key is not None and self.by_key[key] >= self.per_key:
                self.rejected[model, PER_KEY_LIMIT] += 1
                raise APIError(
                    f"rate limit: this API key already has {self.per_key} requests in flight; "
                    "retry when one ends", 429, retry_after=RETRY_AFTER_S)
            self.in_flight[model] += 1
            if key is not None:
                self.by_key[key] += 1
            return Ticket(self, model, key, time.time() + self.max_queue_wait_s)

    def check_room(self, draining: bool = False) -> None:
        """Before a body is even read: when the server is stopping, or every model is full,
        nothing this request could ask for would be admitted, so the refusal skips the parse (a
        burst is shed at its cheapest)."""
        if draining:
            model = next(iter(self.limits)) if len(self.limits) == 1 else "*"
            with self._lock:
                self.rejected[model, DRAINING] += 1
            raise APIError("the server is shutting down; retry (another replica, or after it "
                           "restarts)", 503, retry_after=RETRY_AFTER_S)
        if all(self.in_flight[m] >= limit for m, limit in self.limits.items()):
            model = next(iter(self.limits)) if len(self.limits) == 1 else "*"
            with self._lock:
                self.rejected[model, OVERLOADED] += 1
            raise APIError("the server is overloaded: every model has as many requests in flight "
                           "as it can hold; retry later", 503, retry_after=RETRY_AFTER_S)

    def count_rejection(self, model: str, reason: str) -> None:
        with self._lock:
            self.rejected[model, reason] += 1

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            self.in_flight[ticket.model] -= 1
            if ticket.key is not None:
                self.by_key[ticket.key] -= 1
                if self.by_key[ticket.key] <= 0:
                    del self.by_key[ticket.key]
