"""One `bench serve` load split over several client processes.

A single Python process parsing SSE becomes the bottleneck long before a GPU server does: on the
H100, one `bench serve` process at 256 streams used 87% of a core, and its own queueing showed up
as seconds of TTFT that no server component had (the same server measured 4,383 tok/s and 1.39 s
TTFT p50 from one process, 10,305 and 0.82 s from two, 12,709 and 0.73 s from four). Each process
here runs its share of the requests, of the concurrency cap and of the arrival rate on its own
event loop and connection pool; the parent merges the outcomes on the machine's monotonic clock,
which `time.perf_counter` reads in every process alike."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from benchmarks.client import ClientConfig, StreamingClient
from benchmarks.datasets import BenchRequest
from benchmarks.records import RequestOutcome

if TYPE_CHECKING:  # serve.py imports this module
    from benchmarks.serve import RunSettings

# a process's share of streams above which `auto` adds another client process
STREAMS_PER_PROCESS = 64
_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Share:
    """One client process's part of the load: which requests, at what concurrency and rate."""

    indices: tuple[int, ...]
    max_concurrency: int | None
    request_rate: float
    seed: int


def auto_num_clients(max_concurrency: int | None, num_requests: int,
                     cpu_count: int | None = None) -> int:
    """One process per `STREAMS_PER_PROCESS` streams in flight, using at most half the cores
    (the rest are the server's when it runs on the same machine)."""
    streams = min(max_concurrency or num_requests, num_requests)
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, min(cores // 2, math.ceil(streams / STREAMS_PER_PROCESS)))


def split(num_requests: int, max_concurrency: int | None, request_rate: float, seed: int,
          num_clients: int) -> list[Share]:
    """Requests dealt round-robin; the cap and the rate divided so that together the processes
    send what one would (a Poisson stream split k ways is k Poisson streams at rate/k)."""
    k = max(1, min(num_clients, num_requests, max_concurrency or num_requests))
    shares = []
    for i in range(k):
        cap = (None if max_concurrency is None
               else max_concurrency // k + (1 if i < max_concurrency % k else 0))
        shares.append(Share(tuple(range(i, num_requests, k)), cap, request_rate / k, seed + i))
    return shares


def _client_entry(index: int, config: ClientConfig, requests: list[BenchRequest],
                  settings: RunSettings, barrier: Any, messages: Any) -> None:
    try:
        outcomes, start, end = asyncio.run(_client_main(config, requests, settings, barrier,
                                                        lambda: messages.put(("done", index))))
        messages.put(("result", index, outcomes, start, end))
    # whatever failed, the parent reports it: a failed child must not hang the others or the run
    except Exception as exc:  # noqa: BLE001
        barrier.abort()
        messages.put(("error", index, f"{type(exc).__name__}: {exc}"))


async def _client_main(config: ClientConfig, requests: list[BenchRequest], settings: RunSettings,
                       barrier: Any, on_done: Callable[[], None]
                       ) -> tuple[list[RequestOutcome], float, float]:
    from benchmarks.serve import dispatch

    async with StreamingClient(config) as client:
        # every process starts sending at once, after all have imported and built their clients
        await asyncio.to_thread(barrier.wait, _START_TIMEOUT_S)
        start = time.perf_counter()
        outcomes = await dispatch(client.send, requests, settings, start, on_done)
        return outcomes, start, time.perf_counter()


async def run_shares(config: ClientConfig, requests: Sequence[BenchRequest], settings: RunSettings,
                     shares: list[Share]) -> tuple[list[RequestOutcome], float, float]:
    """(outcomes in request order, first start, last end), each share in its own process."""
    ctx = multiprocessing.get_context("spawn")  # no fork of the parent's event loop and sockets
    barrier = ctx.Barrier(len(shares))
    messages = ctx.Queue()
    procs = []
    for i, share in enumerate(shares):
        part = [requests[j] for j in share.indices]
        own = replace(settings, max_concurrency=share.max_concurrency,
                      request_rate=share.request_rate, seed=share.seed, num_warmups=0,
                      show_progress=False)
        procs.append(ctx.Process(target=_client_entry, daemon=True,
                                 args=(i, config, part, own, barrier, messages)))
    for p in procs:
        p.start()
    progress = tqdm(total=len(requests), disable=not settings.show_progress, unit="req")
    results: dict[int, tuple[list[RequestOutcome], float, float]] = {}
    try:
        while len(results) < len(procs):
            try:
                msg = await asyncio.to_thread(messages.get, True, 1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in results]
                if dead:
                    raise RuntimeError(f"client process {dead[0]} exited with code "
                                       f"{procs[dead[0]].exitcode} before reporting") from None
                continue
            if msg[0] == "done":
                progress.update(1)
            elif msg[0] == "result":
                results[msg[1]] = (msg[2], msg[3], msg[4])
            else:
                raise RuntimeError(f"client process {msg[1]} failed: {msg[2]}")
    finally:
        progress.close()
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(5)
    outcomes: list[RequestOutcome | None] = [None] * len(requests)
    for i, share in enumerate(shares):
        for j, outcome in zip(share.indices, results[i][0]):
            outcomes[j] = outcome
    start = min(r[1] for r in results.values())
    end = max(r[2] for r in results.values())
    return [o for o in outcomes if o is not None], start, end
