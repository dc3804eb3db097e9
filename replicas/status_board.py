"""The status board: where model replicas publish their engine's state and the ingress reads it.

`/health` and `/metrics` must answer at peak, and every call through a model deployment's handle
takes one of the replica's request slots (`max_ongoing_requests`) and waits in its router's queue
behind generation work. So the state travels on a path of its own: each replica pushes a small
stats dict every `REPORT_PERIOD_S` to one named, CPU-less async actor per application, and each
ingress replica pulls the whole board on the same period into a local snapshot that its routes
read without awaiting anything.

The board also carries the application's draining flag: `shardserve serve`, stopping, raises it,
and every ingress then answers new generation requests with 503 (and /health says so) while what
is in flight finishes. And each ingress's reads are its heartbeat: it reads with its id and the
models it serves, so `/health`, an application of its own (serve_app/health.py), can tell from
the board alone whether an ingress is running and every model it serves has a healthy replica.
And it carries the one message an ingress sends a replica mid-request: a choice ended at a stop
string after so many tokens (`stop_choice`), which the replica long-polls for (`take_stops`).

The board is owned by whichever process created it first; if that process goes away the board
goes with it, and the next report or read creates it again (`get_if_exists`), so nothing outlives
the application."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import ray

logger = logging.getLogger(__name__)

REPORT_PERIOD_S = 0.5
# a replica whose last report is older than this is taken as gone (its process died or its
# event loop is wedged)
STALE_AFTER_S = 5.0
# an ingress that has not read the board for this long is wedged, not busy (its loop still
# reads every ~5 s with 5,000 requests arriving at once on 2 cores)
INGRESS_STALE_AFTER_S = 10.0
NAMESPACE = "shardserve"

# model -> replica -> (reported at, stats)
Reports = dict[str, dict[str, tuple[float, dict[str, Any]]]]
# ingress replica -> (last read at, the models it serves)
Ingresses = dict[str, tuple[float, tuple[str, ...]]]


@ray.remote(num_cpus=0, max_concurrency=1000)
class StatusBoard:
    def __init__(self) -> None:
        self.reports: Reports = {}
        self.draining = False
        self.ingresses: Ingresses = {}
        # replica -> (choices the ingress ended at a stop string, when the replica last asked)
        self.stops: dict[str, tuple[asyncio.Queue, float]] = {}

    def _mailbox(self, replica: str) -> asyncio.Queue:
        box = self.stops.get(replica, (asyncio.Queue(), 0.0))[0]
        self.stops[replica] = (box, time.time())
        return box

    async def stop_choice(self, replica: str, request_id: str, choice: int, kept: int) -> None:
        """From an ingress: end a choice at `kept` output tokens (Engine.stop_choice)."""
        self._mailbox(replica).put_nowait((request_id, choice, kept))

    async def take_stops(self, replica: str) -> list[tuple[str, int, int]]:
        """A replica's long poll for its stop_choice messages (empty after a quiet while)."""
        box = self._mailbox(replica)
        try:
            out = [await asyncio.wait_for(box.get(), timeout=STALE_AFTER_S)]
        except TimeoutError:
            return []
        while not box.empty():
            out.append(box.get_nowait())
        return out

    async def set_draining(self, draining: bool) -> None:
        self.draining = draining

    async def report(self, model: str, replica: str, stats: dict[str, Any]) -> None:
        self.reports.setdefault(model, {})[replica] = (time.time(), stats)

    async def forget(self, model: str, replica: str) -> None:
        self.reports.get(model, {}).pop(replica, None)

    async def read(self, ingress: str | None = None,
                   models: tuple[str, ...] = ()) -> tuple[Reports, bool, Ingresses]:
        """The board; an ingress passes its id and models (its heartbeat)."""
        now = time.time()
        if ingress is not None:
            self.ingresses[ingress] = (now, models)
        for replicas in self.reports.values():  # replicas gone for good stop being reported
            for replica in [r for r, (t, _) in replicas.items() if now - t > 10 * STALE_AFTER_S]:
                del replicas[replica]
        for gone in [i for i, (t, _) in self.ingresses.items() if now - t > 10 * STALE_AFTER_S]:
            del self.ingresses[gone]
        for gone in [r for r, (_, t) in self.stops.items() if now - t > 10 * STALE_AFTER_S]:
            del self.stops[gone]
        return self.reports, self.draining, self.ingresses


def board_name(app_name: str) -> str:
    return f"status-board-{app_name}"


def get_board(app_name: str) -> Any:
    return StatusBoard.options(name=board_name(app_name), namespace=NAMESPACE,
                               get_if_exists=True).remote()


def app_name_here(default: str = "shardserve") -> str:
    """The Serve application this replica belongs to (the default outside Serve)."""
    try:
        from ray import serve
        return serve.get_replica_context().app_name or default
    except Exception:  # not inside a Serve replica (unit tests, `bench engine`)
        return default


async def _board_loop(app_name: str, what: str, step: Callable[[Any], Awaitable[None]],
                      period_s: float | None) -> None:
    """Runs `step(board)` until cancelled, finding the board again after a failure (it goes
    with its owner, or Ray is shutting down); pauses `period_s` between steps (None: only after
    a failure, the step waiting by itself)."""
    board = None
    while True:
        failed = False
        try:
            if board is None:
                board = get_board(app_name)
            await step(board)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.debug("%s failed: %s", what, exc)
            board, failed = None, True
        if period_s is not None or failed:
            await asyncio.sleep(REPORT_PERIOD_S if period_s is None else period_s)


async def publish_forever(app_name: str, model: str, replica: str,
                          stats: Callable[[], dict[str, Any]]) -> None:
    """A replica's reporter task: pushes `stats()` every period until cancelled."""
    async def report(board: Any) -> None:
        await asyncio.wait_for(board.report.remote(model, replica, stats()),
                               timeout=STALE_AFTER_S)
    await _board_loop(app_name, "status report", report, REPORT_PERIOD_S)


async def take_stops_forever(app_name: str, replica: str,
                             apply: Callable[[str, int, int], None]) -> None:
    """A replica's task: applies the stop_choice messages ingresses send it until cancelled."""
    async def take(board: Any) -> None:
        for request_id, choice, kept in await board.take_stops.remote(replica):
            apply(request_id, choice, kept)
    await _board_loop(app_name, "stop messages", take, None)


def unhealthy_reason(model: str, reports: list[dict[str, Any]]) -> str | None:
    """Why a model cannot serve, from its replicas' recent reports; None when one of them can
    (its engine loop alive, not failed, no step wedged)."""
    if not reports:
        return f"no replica of {model} has reported its state in the last {STALE_AFTER_S:g} s"
    if any(r["failed"] is None and r["loop_alive"] and not r["stalled"] for r in reports):
        return None
    why = next((r["failed"] for r in reports if r["failed"]), None)
    if why is None:
        why = ("the engine loop is not running" if not any(r["loop_alive"] for r in reports)
               else "an engine step is wedged")
    return f"no healthy replica of {model}: {why}"


class BoardReader:
    """A reader's side (an ingress, the /health app): a background task keeps a copy of the
    board fresh; routes read it without awaiting anything. An ingress gives its id and models,
    so its reads are its heartbeat."""

    def __init__(self, app_name: str, ingress: str | None = None,
                 models: tuple[str, ...] = ()) -> None:
        self.app_name = app_name
        self.ingress, self.models = ingress, models
        self.snapshot: Reports = {}
        self.draining = False
        self.ingresses: Ingresses = {}
        self.read_at = 0.0  # time.time() of the last successful read
        self.board: Any = None  # the board's actor handle, the last one found
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        board = None
        while True:
            try:
                if board is None:
                    board = self.board = get_board(self.app_name)
                self.snapshot, self.draining, self.ingresses = await asyncio.wait_for(
                    board.read.remote(self.ingress, self.models), timeout=STALE_AFTER_S)
                self.read_at = time.time()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.debug("status board read failed: %s", exc)
                # found again next time; stop messages still go to the last one found meanwhile
                # (a read that timed out under load leaves the board where it was)
                board = None
            await asyncio.sleep(REPORT_PERIOD_S)

    def stop_choice(self, replica: str, request_id: str, choice: int, kept: int) -> bool:
        """Tells `replica` (through the board) that a choice ended at a stop string after `kept`
        output tokens; False when the board is not reachable now."""
        if self.board is None:
            return False
        try:
            self.board.stop_choice.remote(replica, request_id, choice, kept)
        except Exception as exc:  # noqa: BLE001 (Ray shutting down: the caller cancels instead)
            logger.debug("stop message not sent: %s", exc)
            return False
        return True

    def fresh(self, model: str) -> list[dict[str, Any]]:
        """The stats of the model's replicas that reported recently."""
        now = time.time()
        if now - self.read_at > STALE_AFTER_S:
            return []
        return [stats for t, stats in self.snapshot.get(model, {}).values()
                if now - t <= STALE_AFTER_S]

    def why_unhealthy(self) -> str | None:
        """Why /health answers 503 (None: 200): the server is stopping, no ingress has run
        recently, or a model an ingress serves has no healthy replica."""
        if self.draining:
            return "the server is shutting down"
        now = time.time()
        if now - self.read_at > STALE_AFTER_S:
            return f"the status board has not been read in the last {STALE_AFTER_S:g} s"
        live = [models for t, models in self.ingresses.values()
                if now - t <= INGRESS_STALE_AFTER_S]
        if not live:
            return f"no ingress has run in the last {INGRESS_STALE_AFTER_S:g} s"
        for model in sorted({m for models in live for m in models}):
            why = unhealthy_reason(model, self.fresh(model))
            if why is not None:
                return why
        return None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
