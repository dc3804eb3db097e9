"""Builds outlines-core Indexes in worker processes that are killed when they take too long.

Compiling a regex into a token automaton costs DFA states x vocabulary and can take minutes
(`[A-Z][^.!?\\n]{0,100}[.!?]`); the Rust code cannot be interrupted, so the only way to really stop
it is to kill the process doing it. Each worker holds the vocabulary (sent once at start), builds
one Index at a time and sends it back pickled. A worker that times out, dies or runs out of its
memory cap is killed and replaced on demand; the others keep working.

This module imports only outlines-core so that a spawned worker starts quickly (no torch).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import outlines_core


class BuildTimeout(Exception):
    """The build ran past its time limit; the worker was killed."""


class BuildFailed(Exception):
    """outlines-core refused the regex (its message), or the worker died (e.g. memory cap)."""


def _worker_main(conn: multiprocessing.connection.Connection, vocabulary: outlines_core.Vocabulary,
                 max_memory_bytes: int | None) -> None:
    if max_memory_bytes:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (max_memory_bytes, max_memory_bytes))
    conn.send(("ready", None))
    while True:
        try:
            regex = conn.recv()
        except (EOFError, OSError):
            return
        try:
            index = outlines_core.Index(regex, vocabulary)
            conn.send(("ok", index))
        except MemoryError:
            conn.send(("error", "the constraint needs more memory than allowed to compile"))
        except Exception as e:  # outlines-core reports bad regexes as ValueError/TypeError
            conn.send(("error", str(e)))


@dataclass(eq=False)
class _Worker:
    process: Any  # multiprocessing.Process (spawn context)
    conn: multiprocessing.connection.Connection
    ready: bool = False

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class IndexBuilder:
    """A pool of `processes` killable workers building `outlines_core.Index(regex, vocabulary)`.

    `await build(regex, timeout_s)` waits off the event loop; the time limit counts from the moment
    a worker takes the job (waiting for a free worker is not counted). Use from one event loop.
    """

    def __init__(self, vocabulary: outlines_core.Vocabulary, processes: int = 2,
                 max_memory_mb: int | None = 4096) -> None:
        self._vocabulary = vocabulary
        self._max_memory = max_memory_mb * 2**20 if max_memory_mb else None
        self._ctx = multiprocessing.get_context("spawn")  # fork is unsafe next to threads (torch, Ray)
        self._size = max(1, processes)
        self._workers: set[_Worker] = set()
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._slots: asyncio.Semaphore | None = None
        self._threads = ThreadPoolExecutor(max_workers=self._size, thread_name_prefix="index-wait")
        self._closed = False

    def start(self) -> None:
        """Start all workers now (optional: build() starts them on demand)."""
        with self._lock:
            while len(self._workers) < self._size:
                self._idle.append(self._spawn())

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_worker_main, name="outlines-index-builder",
                                    args=(child, self._vocabulary, self._max_memory), daemon=True)
        process.start()
        child.close()
        worker = _Worker(process, parent)
        self._workers.add(worker)
        return worker

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise BuildFailed("the compiler is closed")
            return self._idle.pop() if self._idle else self._spawn()

    def _retire(self, worker: _Worker, healthy: bool) -> None:
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
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._size)
        async with self._slots:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._threads, self._build_blocking, regex, timeout_s)

    def _build_blocking(self, regex: str, timeout_s: float) -> outlines_core.Index:
        worker = self._take()
        try:
            if not worker.ready:  # a fresh process: wait for its imports, not counted in the limit
                if not worker.conn.poll(60.0):
                    raise BuildFailed("the compile worker did not start")
                worker.conn.recv()
                worker.ready = True
            worker.conn.send(regex)
            if not worker.conn.poll(timeout_s):
                raise BuildTimeout()
            status, payload = worker.conn.recv()
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
