"""The replica's side of its engine core: starts it, watches it, and fans its outputs out.

`ProcessCore` runs the core in a process of its own (replicas/engine_core.py) and talks to it over
two ZeroMQ IPC sockets: one message of commands per turn of the replica's event loop one way, one
message per engine step the other. A monitor thread supervises it: when the process dies, its
step has run longer than `step_timeout_s` (a hung forward), it has been silent for
`core_silence_s`, or its engine loop failed, the process is killed, every request in flight gets
a 503 at once, and a new core starts (health is red meanwhile; after `MAX_RESTARTS` in
`RESTART_WINDOW_S` it stays red and Serve replaces the replica).

`InProcessCore` runs the same EngineCore on the caller's event loop: the engine alone, for
`bench engine`'s baseline and for tests of engine logic. Both hand outputs to `Streams`."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from replicas import core_protocol as proto
from replicas.outbox import Outbox
from replicas.replica_config import CoreSpec
from replicas.request import RETRY_AFTER_S, EngineError, GenerateRequest, TokenBatch

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 900.0  # loading a big model from a slow disk
MAX_RESTARTS, RESTART_WINDOW_S = 5, 300.0
# a core silent this long (six heartbeats) gets no new requests from the routers while another
# replica takes them; it is killed only after `core_silence_s`
SUSPECT_SILENCE_S = 3.0
# what stats() says before a core's first heartbeat
NO_STATS = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "failed": None,
            "loop_alive": True, "stalled": False, "step_running_s": 0.0}


def _unavailable(why: str) -> EngineError:
    return EngineError(f"the model replica's engine failed and is restarting: {why}",
                       status=503, type_="ServiceUnavailableError", retry_after=RETRY_AFTER_S)


class Streams:
    """request id -> its Outbox, on the replica's event loop."""

    def __init__(self) -> None:
        self.outboxes: dict[str, Outbox] = {}

    def open(self, request_id: str) -> Outbox:
        box = self.outboxes[request_id] = Outbox()
        return box

    def close(self, request_id: str) -> None:
        self.outboxes.pop(request_id, None)

    def dispatch(self, outputs: list[tuple[str, TokenBatch]],
                 errors: list[tuple[str, BaseException]]) -> None:
        """One step's outputs as the in-process engine makes them (the engine-alone baseline
        keeps its objects: no rows made and decoded again)."""
        boxes = self.outboxes
        for request_id, batch in outputs:
            box = boxes.get(request_id)
            if box is None:
                continue
            if box.channel is None:
                box.put(batch)
                continue
            box.channel.put_row(proto.batch_row(request_id, batch))
            if batch.finish_reason is not None:
                box.put(batch)
        self._fail(errors)

    def dispatch_rows(self, rows: list[list], errors: list[tuple[str, BaseException]],
                      ended: list[list] = ()) -> None:  # type: ignore[assignment]
        """One step's outputs as the core process sends them (`proto.batch_row`). A channeled
        request's rows go to its channel undecoded (only its choices' last batches are decoded,
        to end its `generate`): the front makes no objects per token for it. `ended`: last
        batches the core sent their ingress itself (a direct channel): they only end requests."""
        boxes = self.outboxes
        for row in ended:
            box = boxes.get(row[0])
            if box is not None:
                box.put(proto.row_batch(row))
        for row in rows:
            box = boxes.get(row[0])
            if box is None:
                continue
            if box.channel is None:
                box.put(proto.row_batch(row))
                continue
            box.channel.put_row(row)
            if row[3] is not None:  # its finish_reason
                box.put(proto.row_batch(row))
        self._fail(errors)

    def _fail(self, errors: list[tuple[str, BaseException]]) -> None:
        for request_id, exc in errors:
            box = self.outboxes.pop(request_id, None)
            if box is not None:
                box.put(exc)

    def fail_all(self, exc: EngineError) -> None:
        boxes, self.outboxes = self.outboxes, {}
        for box in boxes.values():
            box.put(exc)


class InProcessCore:
    """The engine core on the caller's event loop (no process, no sockets)."""

    def __init__(self, spec: CoreSpec) -> None:
        from replicas.engine_core import EngineCore  # torch and the model: only in-process
        self.core = EngineCore(spec)
        self.engine = self.core.engine
        self.info = self.core.info
        self.streams = Streams()
        self.core.connect(self.streams.dispatch)

    def add(self, request: GenerateRequest) -> Outbox:
        box = self.streams.open(request.request_id)
        self.core.add(request)
        return box

    def abort(self, request_id: str) -> None:
        self.streams.close(request_id)
        self.core.abort(request_id)

    def stop_choice(self, request_id: str, choice: int, kept: int) -> None:
        self.engine.stop_choice(request_id, choice, kept)

    def stats(self) -> dict[str, Any]:
        return {**self.core.stats(), "core_pid": os.getpid(), "core_restarts": 0}

    async def fresh_stats(self) -> dict[str, Any]:
        return self.stats()

    def taking_requests(self) -> bool:
        return not self.engine.failed

    def failure(self) -> str | None:
        return self.engine.failed

    def close(self) -> None:
        self.core.shutdown()


class ProcessCore:
    """The engine core in its own process, supervised."""

    def __init__(self, spec: CoreSpec) -> None:
        import zmq

        self._zmq = zmq
        self.spec = spec
        self.streams = Streams()
        self.info: dict[str, Any] = {}
        self.restarts = 0
        self._restart_times: list[float] = []
        self.failed: str | None = "starting"  # why it cannot take requests now, or None
        self.ingresses: dict[str, str] = {}  # direct channels: ingress -> its socket's address
        self._ctx = zmq.Context()
        self._dir = tempfile.mkdtemp(prefix="shardserve-core-")  # 0700: only we can connect
        self._generation = itertools.count()
        self._proc: subprocess.Popen | None = None
        self._push: Any = None
        self._push_lock = threading.Lock()  # the loop sends; the monitor closes
        self._readers: list[threading.Thread] = []
        self._stats: dict[str, Any] = dict(NO_STATS)
        self._heard = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: list[tuple] = []
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._stats_tokens = itertools.count()
        self._closing = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        # the monitor thread starts every core: the kernel's parent-death signal follows the
        # thread that started a process, and this thread lives as long as the replica
        self._monitor = threading.Thread(target=self._supervise, name="core-monitor",
                                         daemon=True)
        self._monitor.start()
        self._ready.wait()
        if self._start_error is not None:
            raise RuntimeError(f"the engine core did not start: {self._start_error}")

    # ---- requests ------------------------------------------------------------------------------
    def add(self, request: GenerateRequest) -> Outbox:
        if self.failed is not None:
            raise _unavailable(self.failed)
        self._loop = asyncio.get_running_loop()
        box = self.streams.open(request.request_id)
        self._send((proto.ADD, request))
        return box

    def abort(self, request_id: str) -> None:
        self.streams.close(request_id)
        self._send((proto.ABORT, request_id))

    def stop_choice(self, request_id: str, choice: int, kept: int) -> None:
        self._send((proto.STOP, request_id, choice, kept))

    def connect_ingress(self, ingress: str, address: str) -> None:
        """A direct channel: the core sends the rows of requests marked with this ingress to
        `address` (replicas/channel.py); a core that restarts is told again."""
        self.ingresses[ingress] = address
        self._send((proto.CONNECT, ingress, address))

    def disconnect_ingress(self, ingress: str) -> None:
        if self.ingresses.pop(ingress, None) is not None:
            self._send((proto.DISCONNECT, ingress))

    def _send(self, command: tuple) -> None:
        """Commands of one turn of the event loop leave together, as one message."""
        if not self._commands:
            asyncio.get_running_loop().call_soon(self._flush)
        self._commands.append(command)

    def _flush(self) -> None:
        commands, self._commands = self._commands, []
        with self._push_lock:
            if self._push is None or self.failed is not None:
                return  # no core to tell: what it held has failed already
            try:
                # never waiting: the socket binds, so with its core gone a send would wait for a
                # peer that never comes, holding the event loop and the lock the monitor needs
                # to restart the core (a chaos run wedged a replica so); `_start` sends nothing
                # before the core's end is connected, so this fails only once the core is gone
                self._push.send(proto.encode_commands(commands), self._zmq.NOBLOCK)
            except self._zmq.ZMQError:  # the core is going down: the monitor fails its requests
                logger.warning("engine core unreachable; %d commands dropped", len(commands))

    # ---- state ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The core's last heartbeat (at most HEARTBEAT_S old) and the supervisor's view."""
        stats = dict(self._stats)
        if self.failed is not None:
            stats["failed"] = self.failed
        return self._with_supervisor(stats)

    def _with_supervisor(self, stats: dict[str, Any]) -> dict[str, Any]:
        return {**stats, "core_pid": self._proc.pid if self._proc else None,
                "core_restarts": self.restarts}

    async def fresh_stats(self) -> dict[str, Any]:
        """Asks the core for its counters now (tests and benchmarks)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        token = next(self._stats_tokens)
        waiter = self._stats_waiters[token] = loop.create_future()
        self._send((proto.STATS, token))
        try:
            stats = await asyncio.wait_for(waiter, 30)
        finally:
            self._stats_waiters.pop(token, None)
        return self._with_supervisor(stats)

    def taking_requests(self) -> bool:
        """Up (not down, restarting or given up) and heard from within SUSPECT_SILENCE_S."""
        return (self.failed is None
                and time.monotonic() - self._heard < SUSPECT_SILENCE_S
                and not self._stats.get("failed"))

    def failure(self) -> str | None:
        """Why the replica is unhealthy: only once restarting has been given up."""
        return self.failed if self._gave_up() else None

    def _gave_up(self) -> bool:
        now = time.monotonic()
        return len([t for t in self._restart_times if now - t < RESTART_WINDOW_S]) > MAX_RESTARTS

    # ---- the process ---------------------------------------------------------------------------
    def _start(self) -> None:
        zmq = self._zmq
        gen = next(self._generation)
        in_addr = f"ipc://{self._dir}/in-{gen}"
        out_addr = f"ipc://{self._dir}/out-{gen}"
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.setsockopt(zmq.LINGER, 0)
        push.bind(in_addr)
        pull = self._ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 0)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(out_addr)
        spec_file = os.path.join(self._dir, f"spec-{gen}")
        with open(os.open(spec_file, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            pickle.dump(self.spec, f)
        env = dict(os.environ)
        # the core imports what this process imports (a Ray job's working_dir and py_modules)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # No GOMP_SPINCOUNT of ours: libgomp's default spin (300,000 rounds, milliseconds) keeps
        # the OpenMP threads awake across a step's Python. A core spinning 10,000 rounds slept
        # and was woken several times a step: served single-stream TPOT 1.1-1.4x (2-core Zen 4,
        # three alternating pairs), 32 streams no faster, and a burst's refusals came within
        # the same bound (benchmarks/RESULTS.md, 2026-12-02).
        proc = subprocess.Popen(
            [sys.executable, "-m", "replicas.engine_core", "--spec", spec_file,
             "--input", in_addr, "--output", out_addr, "--parent", str(os.getpid())],
            env=env, stdin=subprocess.DEVNULL)
        self._heard = time.monotonic()
        deadline = time.monotonic() + READY_TIMEOUT_S
        ready = False
        # until it says it is ready and its end of the command socket is connected (then a
        # send never waits while it lives: `_flush`)
        while not (ready and push.poll(0, zmq.POLLOUT)):
            if not ready and pull.poll(200):
                message = proto.decode(pull.recv())
                if message[0] == proto.READY:
                    self.info = message[1]
                    ready = True
            elif ready:
                time.sleep(0.005)
            if proc.poll() is not None:
                push.close()
                pull.close()
                raise RuntimeError(f"it exited with code {proc.returncode} before it was ready "
                                   "(its log is in this replica's log)")
            if time.monotonic() > deadline or self._closing.is_set():
                proc.kill()
                proc.wait()
                push.close()
                pull.close()
                raise RuntimeError(f"it was not ready within {READY_TIMEOUT_S:.0f} s")
        self._stats = dict(NO_STATS)
        if self.ingresses:  # a restarted core: the direct channels still open, before any request
            with contextlib.suppress(zmq.ZMQError):  # gone already: the monitor sees it exit
                push.send(proto.encode_commands(
                    [(proto.CONNECT, ingress, address)
                     for ingress, address in list(self.ingresses.items())]), zmq.NOBLOCK)
        with self._push_lock:
            self._proc, self._push = proc, push
        self._heard = time.monotonic()
        reader = threading.Thread(target=self._read, args=(pull, proc), name="core-output",
                                  daemon=True)
        reader.start()
        self._readers = [t for t in self._readers if t.is_alive()] + [reader]
        self.failed = None
        logger.info("engine core %d started (pid %d)", gen, proc.pid)

    def _read(self, pull: Any, proc: subprocess.Popen) -> None:
        """Decodes the core's messages off the event loop; a step's outputs reach the loop as
        one callback."""
        try:
            while not self._closing.is_set() and self._proc is proc:
                if not pull.poll(200):
                    continue
                message = proto.decode(pull.recv())
                self._heard = time.monotonic()
                kind = message[0]
                if kind == proto.STEP:
                    self._call(self.streams.dispatch_rows, message[1],
                               proto.decode_errors(message[2]), message[3])
                elif kind == proto.BEAT:
                    self._stats = message[1]
                elif kind == proto.STATS:
                    self._call(self._answer_stats, message[1], message[2])
        finally:
            pull.close(linger=0)

    def _answer_stats(self, token: int, stats: dict[str, Any]) -> None:
        waiter = self._stats_waiters.get(token)
        if waiter is not None and not waiter.done():
            waiter.set_result(stats)

    def _call(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)

    def _why_down(self) -> str | None:
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is not None:
            return f"the engine core process exited (code {proc.returncode})"
        silent = time.monotonic() - self._heard
        if silent > self.spec.config.core_silence_s:
            return f"the engine core sent nothing for {silent:.0f} s"
        stats = self._stats
        if stats.get("step_running_s", 0.0) > self.spec.config.step_timeout_s:
            return f"an engine step ran for over {self.spec.config.step_timeout_s:g} s"
        if stats.get("failed"):
            return str(stats["failed"])
        return None

    def _supervise(self) -> None:
        """Starts the core, restarts it when it goes down, and stops it on close: the core dies
        with the thread that started it (PR_SET_PDEATHSIG follows the creating thread, not the
        process), so the graceful stop is this thread's last act."""
        try:
            self._start()
        except BaseException as exc:  # noqa: BLE001  (reported to the constructor)
            self._start_error = exc
        finally:
            self._ready.set()
        if self._start_error is not None:
            return
        while not self._closing.wait(0.2):
            if self._supervise_once():
                return
        self._stop_process(kill=False)

    def _supervise_once(self) -> bool:
        """One look at the core: restarts it if it is down; True when it gave up."""
        why = self._why_down()
        if why is None:
            return False
        logger.error("engine core down: %s; restarting it", why)
        self.failed = why
        self._stop_process(kill=True)
        self._call(self.streams.fail_all, _unavailable(why))
        self._call(self._fail_stats_waiters)
        self._restart_times.append(time.monotonic())
        self.restarts += 1
        if self._gave_up():
            logger.error("engine core restarted %d times in %.0f s: giving up (the replica "
                         "reports unhealthy)", MAX_RESTARTS, RESTART_WINDOW_S)
            return True
        try:
            self._start()
        except Exception as exc:
            self.failed = f"{why}; then a new core did not start: {exc}"
            self._restart_times.extend([time.monotonic()] * MAX_RESTARTS)
            return True
        return False

    def _fail_stats_waiters(self) -> None:
        for waiter in self._stats_waiters.values():
            if not waiter.done():
                waiter.set_exception(_unavailable(self.failed or "stopped"))

    def _stop_process(self, kill: bool) -> None:
        with self._push_lock:
            proc, push = self._proc, self._push
            self._proc = self._push = None
        if proc is None:
            return
        if not kill and proc.poll() is None:
            try:
                push.send(proto.encode_commands([(proto.SHUTDOWN,)]), self._zmq.NOBLOCK)
                proc.wait(timeout=10)
            except Exception:  # noqa: BLE001  (it is killed below)
                pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        push.close(linger=0)

    def close(self) -> None:
        self._closing.set()
        # (the monitor stops the core gracefully: up to 10 s for its SHUTDOWN)
        self._monitor.join(timeout=15)
        self._stop_process(kill=True)
        self.failed = "stopped"
        for reader in self._readers:
            reader.join(timeout=5)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
