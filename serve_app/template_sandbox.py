"""Per-request chat templates, rendered in killable worker processes under a time, size and memory
limit.

A template is a program: `{% for i in range(100000) %}{% for j in range(100000) %}` runs for hours,
`{{ 'x' * 10**10 }}` asks for 10 GB, and Jinja cannot be interrupted from outside the thread running
it (which would also hold the GIL the whole time). So a request's own `chat_template` (accepted only
with `--trust-request-chat-template`, as vLLM) renders in a small pool of worker processes
(serve_app/template_worker.py: fresh interpreters, transformers' own rendering, an address-space
cap, output cut at the size limit as it streams). A render still going at its time limit gets its
worker killed, and a replacement starts at once.

The workers are few (2), so the time limit counts from the request, every wait included (for a
worker to come free, or for a replacement to finish starting): a flood of templates turns into
prompt 503s (no worker in time) and 400s (the template ran out of time), never an ever longer
queue. And each client (an API key's digest or an address, as the
ingress names it) has at most one render in the workers at a time, its others waiting in a line of
their own on their own clock, so one client cannot hold every worker."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from serve_app.errors import APIError
from structured.worker_process import Worker, spawn

START_TIMEOUT_S = 60.0  # a worker still not started after this is replaced
RETRY_AFTER_S = 1


class _TimedOut(Exception):
    """The render ran out of time; its worker was killed."""


class _NoWorker(Exception):
    """No started worker before the deadline (all busy, or the new one still starting)."""


@dataclass(eq=False)
class _Lane:
    """One client's line: its renders in the workers, and how many of its requests hold it."""
    slots: asyncio.Semaphore
    users: int = 0


class TemplateSandbox:
    """`processes` workers rendering per-request templates.

    timeout_s: the most a render may take from the call, waiting included (400 past it, or 503
    when no worker came free in time). max_chars: the most a rendering may print (400 past it).
    max_memory_mb: each worker's address-space cap (a template that needs more is a 400).
    per_client: renders one client may have in the workers at once. Use from one event loop.
    """

    def __init__(self, processes: int = 2, timeout_s: float = 5.0, max_chars: int = 4 * 2**20,
                 max_memory_mb: int = 1024, per_client: int = 1) -> None:
        self.processes = max(1, processes)
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self.max_memory_mb = max_memory_mb
        self.per_client = per_client
        self._idle: list[Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        # one thread per worker: a render holds a slot before it is handed to a thread, so jobs
        # never queue in the executor, where their deadlines could not be watched
        self._threads = ThreadPoolExecutor(self.processes, thread_name_prefix="template")
        self._slots: asyncio.Semaphore | None = None  # made on the loop that renders
        self._lanes: dict[str, _Lane] = {}

    def start(self) -> None:
        """Start the workers now rather than on the first template (they start in ~0.5 s)."""
        with self._lock:
            while len(self._idle) < self.processes and not self._closed:
                self._idle.append(self._spawn())

    def wait_started(self, timeout_s: float) -> bool:
        """Whether every idle worker (a replacement included) has started within `timeout_s`:
        a render may find a replacement still starting, and that wait counts against its limit.
        For start-up and tests: renders cannot take a worker while it waits."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            for worker in self._idle:
                try:
                    if not worker.started(max(0.0, deadline - time.monotonic())):
                        return False
                except (EOFError, OSError):
                    return False
        return True

    async def render(self, messages: list[dict[str, Any]], *, chat_template: str,
                     tools: list[dict] | None = None, documents: list[dict] | None = None,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     variables: dict[str, Any] | None = None, client: str | None = None) -> str:
        """transformers' rendering of `messages` with `chat_template` and the template
        `variables` (the tokenizer's special tokens, the request's chat_template_kwargs)."""
        deadline = time.monotonic() + self.timeout_s
        job = {"messages": messages, "chat_template": chat_template, "tools": tools,
               "documents": documents, "add_generation_prompt": add_generation_prompt,
               "continue_final_message": continue_final_message, "variables": variables or {}}
        release = await self._turn(client, deadline)
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(self._threads, self._run, job, deadline)
        except BaseException:
            release()
            raise

        def done(f: asyncio.Future) -> None:
            release()
            if not f.cancelled():
                f.exception()  # retrieved: a caller that left no longer will

        # the worker is given back when the render ends, not when a caller that left stops
        # waiting: a client that hangs up cannot start renders beyond the pool
        future.add_done_callback(done)
        try:
            status, payload = await asyncio.shield(future)
        except _TimedOut:
            raise APIError(f"the chat template took longer than {self.timeout_s:g} s to render "
                           "(the server's chat_template_timeout_s)", param="chat_template") from None
        except _NoWorker:
            raise self._busy() from None
        if status == "ok":
            return payload
        if status == "too_large":
            raise APIError(f"the chat template rendered more than the {self.max_chars} characters "
                           "allowed (the server's max_rendered_prompt_chars)",
                           param="chat_template")
        raise APIError(f"chat template error: {payload}", param="chat_template")

    async def _turn(self, client: str | None, deadline: float) -> Callable[[], None]:
        """Waits for `client`'s turn and a free worker before `deadline`; returns the release."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.processes)
        slots = self._slots
        lane = None
        if client is not None:
            lane = self._lanes.setdefault(client, _Lane(asyncio.Semaphore(self.per_client)))
            lane.users += 1
        acquired: list[asyncio.Semaphore] = []

        def release() -> None:
            for semaphore in acquired:
                semaphore.release()
            acquired.clear()
            if lane is not None:
                lane.users -= 1
                if lane.users == 0:
                    del self._lanes[client]

        try:
            for semaphore in ([lane.slots] if lane is not None else []) + [slots]:
                try:
                    await asyncio.wait_for(semaphore.acquire(),
                                           max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise self._busy() from None
                acquired.append(semaphore)
        except BaseException:
            release()
            raise
        return release

    def _busy(self) -> APIError:
        return APIError(f"the chat template workers are busy: none came free within the "
                        f"{self.timeout_s:g} s limit; retry later", 503, param="chat_template",
                        retry_after=RETRY_AFTER_S)

    def _spawn(self) -> Worker:
        return spawn("serve_app.template_worker:main", self.max_chars,
                     self.max_memory_mb * 2**20)

    def _take(self) -> Worker:
        with self._lock:
            if self._closed:
                raise _NoWorker()
            if not self._idle:
                return self._spawn()
            # a started worker (its "ready" maybe not read yet) before one still starting
            worker = next((w for w in self._idle if w.ready or w.outbox.poll()), self._idle[0])
            self._idle.remove(worker)
            return worker

    def _retire(self, worker: Worker, healthy: bool) -> None:
        with self._lock:
            if healthy and not self._closed:
                self._idle.append(worker)
                return
            if not self._closed:  # its replacement starts now, not on the next request
                self._idle.append(self._spawn())
        worker.kill()

    def _run(self, job: dict[str, Any], deadline: float) -> tuple[str, Any]:
        """On a pool thread, holding a slot: one job on one worker."""
        worker = self._take()
        # a replacement still starting: that wait is inside the limit too
        try:
            started = worker.started(max(0.0, deadline - time.monotonic()))
        except (EOFError, OSError):
            self._retire(worker, healthy=False)
            raise _NoWorker() from None
        if not started:
            stuck = time.monotonic() - worker.spawned > START_TIMEOUT_S
            self._retire(worker, healthy=not stuck)
            raise _NoWorker()
        try:
            worker.inbox.send(job)
            if not worker.outbox.poll(max(0.0, deadline - time.monotonic())):
                raise _TimedOut()
            reply = worker.outbox.recv()
        except _TimedOut:
            self._retire(worker, healthy=False)
            raise
        except (EOFError, OSError):
            self._retire(worker, healthy=False)
            return ("error", "the template's worker died (out of memory?)")
        self._retire(worker, healthy=True)
        return reply

    def close(self) -> None:
        """Kill the idle workers (a busy one when its render ends); new renders get 503."""
        with self._lock:
            self._closed = True
            workers, self._idle = self._idle, []
        for worker in workers:
            worker.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)
