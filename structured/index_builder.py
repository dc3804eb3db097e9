"""Builds outlines-core Indexes in worker processes that are killed when they take too long.

Compiling a regex into a token automaton costs DFA states x vocabulary and can take minutes
(`[A-Z][^.!?\\n]{0,100}[.!?]`); the Rust code cannot be interrupted, so the only way to really stop
it is to kill the process doing it. Each worker holds the vocabulary (sent once at start), builds
one Index at a time and sends it back pickled. A worker that times out, dies or runs out of its
memory cap is killed and replaced on demand; the others keep working.

Workers are fresh interpreters that import only this module and outlines-core (no torch), so they
start in about 0.1 s; each runs under an address-space cap.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import outlines_core

from structured.worker_process import Worker, connect, spawn

class BuildTimeout(Exception):
    """The build ran past its time limit; the worker was killed."""


class BuildFailed(Exception):
    """outlines-core refused the regex (its message), or the worker died (e.g. memory cap)."""


def _serve(read_fd: int, write_fd: int) -> None:
    """Worker process main: receive (vocabulary, memory cap), then build Indexes until EOF."""
    inbox, outbox = connect(read_fd, write_fd)
    vocabulary, max_memory_bytes = inbox.recv()
    if max_memory_bytes:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (max_memory_bytes, max_memory_bytes))
    outbox.send(("ready", None))
    while True:
        try:
            regex = inbox.recv()
        except (EOFError, OSError):
            return
        try:
            outbox.send(("ok", outlines_core.Index(regex, vocabulary)))
        except MemoryError:
            outbox.send(("error", "the constraint needs more memory than allowed to compile"))
        except Exception as e:  # noqa: BLE001 (any failure is reported to the parent as a 400)
            outbox.send(("error", str(e)))


class IndexBuilder:
    """A pool of `processes` killable workers building `outlines_core.Index(regex, vocabulary)`.

    `await build(regex, timeout_s)` waits off the event loop; the time limit counts from the call,
    so waiting for a free worker is inside it (a queue of slow compiles turns into prompt 400s
    rather than an ever longer wait), except a fresh worker's start.
    """

    def __init__(self, vocabulary: outlines_core.Vocabulary, processes: int = 2,
                 max_memory_mb: int | None = 4096) -> None:
        self._vocabulary = vocabulary
        self._max_memory = max_memory_mb * 2**20 if max_memory_mb else None
        self._size = max(1, processes)
        self._workers: set[Worker] = set()
        self._idle: list[Worker] = []
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(max_workers=self._size, thread_name_prefix="index-wait")
        self._closed = False

    def start(self) -> None:
        """Start all workers now (optional: build() starts them on demand)."""
        with self._lock:
            while len(self._workers) < self._size:
                self._idle.append(self._spawn())

    def _spawn(self) -> Worker:
        worker = spawn("structured.index_builder:_serve")
        self._workers.add(worker)
        return worker

    def _take(self) -> Worker:
        with self._lock:
            if self._closed:
                raise BuildFailed("the compiler is closed")
            return self._idle.pop() if self._idle else self._spawn()

    def _retire(self, worker: Worker, healthy: bool) -> None:
        with self._lock:
            if healthy and not self._closed:
                self._idle.append(worker)
                return
            self._workers.discard(worker)
        worker.kill()

    async def build(self, regex: str, timeout_s: float) -> outlines_core.Index:
        """Build the Index. Raises BuildTimeout after `timeout_s` of work, BuildFailed otherwise."""
        if self._closed:
            raise RuntimeError("IndexBuilder is closed")
        # One thread per worker: jobs beyond that queue in the executor, on the same clock.
        deadline = time.monotonic() + timeout_s
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self._build_blocking, regex, deadline)

    def _build_blocking(self, regex: str, deadline: float) -> outlines_core.Index:
        if time.monotonic() >= deadline:  # its time went by in the queue
            raise BuildTimeout()
        worker = self._take()
        try:
            if not worker.ready:  # a fresh process: its start is not counted in the time limit
                starting = time.monotonic()
                worker.inbox.send((self._vocabulary, self._max_memory))
                if not worker.started(60.0):
                    raise BuildFailed("the compile worker did not start")
                deadline += time.monotonic() - starting
            worker.inbox.send(regex)
            if not worker.outbox.poll(max(0.0, deadline - time.monotonic())):
                raise BuildTimeout()
            status, payload = worker.outbox.recv()
        except (BuildTimeout, BuildFailed):
            self._retire(worker, healthy=False)
            raise
        except (EOFError, OSError):
            self._retire(worker, healthy=False)
            raise BuildFailed("the constraint is too large to compile (the compile worker died)"
                              ) from None
        self._retire(worker, healthy=True)
        if status == "ok":
            return payload
        raise BuildFailed(payload)

    def close(self) -> None:
        """Kill all workers; builds in progress fail with BuildFailed."""
        with self._lock:
            self._closed = True
            workers, self._workers, self._idle = list(self._workers), set(), []
        for worker in workers:
            worker.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)
