"""OutputPacer: when the engine core hands its steps' outputs on, under a stream floor.

Under a floor (CPUs by default: each request waits at least `floor_s` between two of its SSE
events, serve_app/channels.py) the ingress holds a request's tokens that long anyway, so the core
holds them too: the outputs of the steps within one floor leave as one message, and the replica's
front, which relays them, wakes once a floor instead of once a step. On 2 cores each of its
wake-ups takes a core from one of the engine's two OpenMP threads, and the other waits it out at
the next barrier. What a client waits for goes at once: a choice's first batch (its time to first
token), its last, and a failure. Without a floor every step's outputs go as they come."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from replicas.request import TokenBatch

Outputs = list[tuple[str, TokenBatch]]
Errors = list[tuple[str, BaseException]]


class OutputPacer:
    """`put` takes a step's outputs (the engine's `on_outputs`); `send` gets them, gathered."""

    def __init__(self, send: Callable[[Outputs, Errors], None], floor_s: float = 0.0) -> None:
        self.send = send
        self.floor_s = floor_s
        self._outputs: Outputs = []
        self._errors: Errors = []
        self._sent = float("-inf")  # loop time of the last send
        self._timer: asyncio.TimerHandle | None = None
        self._open: dict[str, set[int]] = {}  # request -> its choices that have had a batch

    def put(self, outputs: Outputs, errors: Errors) -> None:
        if not self.floor_s:
            self.send(outputs, errors)
            return
        self._outputs += outputs
        self._errors += errors
        urgent = bool(errors)
        for request_id, _ in errors:
            self._open.pop(request_id, None)
        for request_id, batch in outputs:
            urgent = self._first_or_last(request_id, batch) or urgent
        loop = asyncio.get_running_loop()
        wait = self._sent + self.floor_s - loop.time()
        if urgent or wait <= 0:
            self.flush()
        elif self._timer is None:
            # the next step normally comes first; this is for a batch that has none after it
            self._timer = loop.call_later(wait, self.flush)

    def _first_or_last(self, request_id: str, batch: TokenBatch) -> bool:
        choices = self._open.get(request_id)
        if batch.finish_reason is not None:
            if choices is not None:
                choices.discard(batch.choice_index)
                if not choices:
                    del self._open[request_id]
            return True
        if choices is None:
            choices = self._open[request_id] = set()
        elif batch.choice_index in choices:
            return False
        choices.add(batch.choice_index)
        return True

    def forget(self, request_id: str) -> None:
        """An aborted request: it gets no last batch."""
        self._open.pop(request_id, None)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._outputs and not self._errors:
            return
        outputs, errors, self._outputs, self._errors = self._outputs, self._errors, [], []
        self._sent = asyncio.get_running_loop().time()
        self.send(outputs, errors)
