"""Constraint spec -> Compiled, off the event loop, cached, within a time limit.

One Compiler per model replica (its vocabulary is fixed). `await compiler.compile(spec)` returns a
`Compiled`; `compiled.new_guide()` makes the per-request Guide (microseconds). Results, failures
included, are kept in an LRU keyed by the spec, and concurrent compiles of one spec share the work.

Time limit: outlines-core builds its automaton eagerly and cannot be interrupted, so it runs in a
killable worker process (structured/index_builder.py) that is killed at the limit. llguidance
compiles lazily in about a millisecond under its own fuel limits (lexer, grammar size), so it runs
in a thread; the limit still bounds what the caller waits. Either way the caller's event loop and
other compiles keep running, and the limit counts from the request, queue wait included.

The workers are few (2), so one client could hold them all with slow constraints and make
everyone else's compiles time out: each client (the ingress names it: an API key's digest or an
address) compiles at most `per_client` new specs at a time, its others wait in a line of its own,
on their own clock. Cached specs, and specs already compiling for anyone, skip the line.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from structured.errors import ConstraintError
from structured.guide import Guide, LLGuidanceGuide, OutlinesAutomaton, outlines_regex
from structured.index_builder import BuildFailed, BuildTimeout, IndexBuilder
from structured.schema_check import Backend, Plan, check_constraint
from structured.spec import Constraint
from structured.vocabulary import Vocabulary


@dataclass(frozen=True, eq=False)
class Compiled:
    """A compiled constraint, shared by every request that uses the same spec."""

    spec: Constraint
    backend: Backend
    compile_time_s: float
    _new_guide: Callable[[], Guide]

    def new_guide(self) -> Guide:
        """A fresh per-request guide at the start state."""
        return self._new_guide()


class Compiler:
    """Compiles specs against one vocabulary.

    timeout_s: the most a compile may take; past it ConstraintError (400).
    cache_size: compiled specs (and failures) kept, least recently used dropped first.
    processes: outlines-core compile workers (each holds a copy of the vocabulary).
    max_memory_mb: address-space cap of each worker; a compile that needs more fails with 400.
    Use from one event loop.
    """

    def __init__(self, vocab: Vocabulary, timeout_s: float = 10.0, cache_size: int = 256,
                 processes: int = 2, max_memory_mb: int | None = 4096,
                 per_client: int = 1) -> None:
        self.vocab = vocab
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[Constraint, Compiled | ConstraintError] = OrderedDict()
        self._inflight: dict[Constraint, asyncio.Future] = {}
        self.per_client = per_client
        self._lanes: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}  # client -> (slots, users)
        self._builder = IndexBuilder(vocab.outlines, processes=processes, max_memory_mb=max_memory_mb)
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="llguidance-compile")

    def start(self) -> None:
        """Warm up now instead of on the first compile: backend vocabularies, worker processes."""
        self.vocab.llguidance  # noqa: B018 (cached property)
        self._builder.start()

    async def compile(self, spec: Constraint, client: str | None = None) -> Compiled:
        """The Compiled for `spec`. Raises ConstraintError when the spec is invalid, unsupported,
        unsatisfiable, too large, or takes longer than timeout_s (from this call, waiting for
        `client`'s turn included) to compile."""
        cached = self._cache.get(spec)
        if cached is not None:
            self._cache.move_to_end(spec)
            if isinstance(cached, ConstraintError):
                raise cached
            return cached
        future = self._inflight.get(spec)
        if future is None:
            deadline = time.monotonic() + self.timeout_s
            future = asyncio.ensure_future(self._in_lane(client, spec, deadline))
            self._inflight[spec] = future
            future.add_done_callback(lambda f: self._finish(spec, f))
        # shield: a cancelled caller (client gone) does not cancel the compile others wait for
        return await asyncio.shield(future)

    async def _in_lane(self, client: str | None, spec: Constraint,
                       deadline: float) -> Compiled:
        """Compiles `spec` once `client` has a free slot, within the same deadline."""
        if client is None:
            return await self._compile(spec, deadline)
        lane = self._lanes.setdefault(client, (asyncio.Semaphore(self.per_client), [0]))
        slots, users = lane
        users[0] += 1
        try:
            try:
                await asyncio.wait_for(slots.acquire(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise self._too_slow(spec) from None
            try:
                return await self._compile(spec, deadline)
            finally:
                slots.release()
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._lanes[client]

    def _too_slow(self, spec: Constraint) -> ConstraintError:
        param = check_constraint(spec).param
        return ConstraintError(f"the {param} constraint took longer than {self.timeout_s:g} s to "
                               "compile", param)

    def _finish(self, spec: Constraint, future: asyncio.Future) -> None:
        self._inflight.pop(spec, None)
        if future.cancelled():
            return
        error = future.exception()
        if error is not None and not isinstance(error, ConstraintError):
            return  # our own bug: do not cache it
        self._cache[spec] = error if error is not None else future.result()
        self._cache.move_to_end(spec)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    async def _compile(self, spec: Constraint, deadline: float) -> Compiled:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        plan = await loop.run_in_executor(self._threads, check_constraint, spec)
        left = max(0.0, deadline - time.monotonic())
        if plan.backend == "outlines":
            new_guide = await self._compile_outlines(plan, left)
        else:
            new_guide = await self._compile_llguidance(plan, left)
        return Compiled(spec, plan.backend, time.perf_counter() - started, new_guide)

    async def _compile_outlines(self, plan: Plan, left: float) -> Callable[[], Guide]:
        try:
            index = await self._builder.build(outlines_regex(plan.source), left)
        except BuildTimeout:
            raise ConstraintError(
                f"the {plan.param} constraint took longer than {self.timeout_s:g} s to compile",
                plan.param) from None
        except BuildFailed as e:
            raise ConstraintError(f"the {plan.param} constraint cannot be compiled: {e}",
                                  plan.param) from None
        automaton = OutlinesAutomaton(index, self.vocab)
        if not automaton.has_final_state():
            raise ConstraintError(f"the {plan.param} constraint can never be complete "
                                  "(its automaton has no final state)", plan.param)
        return automaton.new_guide

    async def _compile_llguidance(self, plan: Plan, left: float) -> Callable[[], Guide]:
        import llguidance

        def build() -> llguidance.LLMatcher:
            return llguidance.LLMatcher(self.vocab.llguidance, plan.source, log_level=0)

        loop = asyncio.get_running_loop()
        try:
            prototype = await asyncio.wait_for(loop.run_in_executor(self._threads, build), left)
        except asyncio.TimeoutError:
            raise ConstraintError(
                f"the {plan.param} constraint took longer than {self.timeout_s:g} s to compile",
                plan.param) from None
        if prototype.is_error():
            raise ConstraintError(f"the {plan.param} constraint cannot be compiled: "
                                  f"{prototype.get_error()}", plan.param)
        vocab = self.vocab
        return lambda: LLGuidanceGuide(prototype.deep_copy(), vocab)

    def close(self) -> None:
        """Stop the compile workers."""
        self._builder.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
