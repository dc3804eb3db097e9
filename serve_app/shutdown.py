"""How `shardserve serve` stops: drain, shut Serve and Ray down, and leave no process behind.

Draining: the status board's draining flag makes every ingress answer new generation requests and
/health with 503 (load balancers stop sending) while the engines finish what they hold, up to
`shutdown_grace_s`; then Serve and Ray are shut down.

Leftovers: Serve's HAProxy manager (an actor) runs `haproxy -db` as its child and reloads it with
`-sf <old pids>`, so at any time there may be a live process and old ones still draining. Its
`stop()` kills them all, but only runs on a graceful Serve shutdown: when the manager's worker dies
another way (its raylet gets SIGTERM, as with `kill -TERM -<pgid>` or `ray stop`, or the shutdown
times out) the haproxy processes are reparented to init and keep the port. That is Ray's doing, so
we work around it here: the processes this command started (its descendants, watched while it
runs) and every haproxy using one of their config files are terminated after Ray is down.

Ray's processes share the command's process group, so `kill -TERM -<pgid>` reaches them too: the
raylet and GCS server survive it, but the agents die and Ray stops answering calls (Ray 2.60), so
the command sees one of Ray's system processes go and ends everything at once (no drain). Should
the command itself be killed or aborted before its `finally` runs, a reaper process in a session
of its own holds what the tracker saw and, once the command is gone however it went, ends the
leftovers."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

import psutil

logger = logging.getLogger(__name__)
RAY_AGENTS = {"ray::DashboardAgent", "ray::RuntimeEnvAgent"}


class ProcessTracker:
    """Remembers this process's descendants and the HAProxy config files they use."""

    def __init__(self, me: psutil.Process | None = None) -> None:
        self.me = me or psutil.Process()
        self.seen: dict[int, psutil.Process] = {}
        self.haproxy_configs: set[str] = set()
        self.system: set[int] = set()  # Ray's system processes among them
        self._reaper: IO[str] | None = None
        self._reaper_pid: int | None = None

    def start_reaper(self) -> None:
        """Starts the process that ends the leftovers if this one dies without doing it."""
        read_fd, write_fd = os.pipe()
        reaper = subprocess.Popen([sys.executable, "-c",
                          f"from serve_app.shutdown import reaper_main; reaper_main({read_fd})"],
                         pass_fds=(read_fd,), start_new_session=True, stdin=subprocess.DEVNULL,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        os.close(read_fd)
        self._reaper = os.fdopen(write_fd, "w", buffering=1)
        self.seen[reaper.pid] = psutil.Process(reaper.pid)  # never its own leftover
        self._reaper_pid = reaper.pid

    def record(self) -> None:
        try:
            children = self.me.children(recursive=True)
        except psutil.Error:
            return
        new = []
        for p in children:
            if p.pid in self.seen:
                continue
            self.seen[p.pid] = p
            if _parent(p) == self.me.pid or _name(p) in RAY_AGENTS:
                self.system.add(p.pid)
            config = _haproxy_config(p)
            if config is not None:
                self.haproxy_configs.add(config)
            try:
                new.append((p.pid, p.create_time()))
            except psutil.Error:
                pass
        if new and self._reaper is not None:
            try:
                self._reaper.write(json.dumps({"pids": new,
                                               "configs": sorted(self.haproxy_configs)}) + "\n")
            except OSError:
                self._reaper = None

    def ray_alive(self) -> bool:
        """Whether every Ray system process this command started still runs: its own children
        (GCS server, raylet, log monitor, dashboard) and the raylet's agents. A signal to the
        whole process group kills some of them at once and leaves Ray unable to answer."""
        system = [self.seen[pid] for pid in self.system]
        return bool(system) and all(_alive(p) for p in system)

    def ray_stopping(self, within_s: float) -> bool:
        """Whether one of Ray's system processes goes away within `within_s` (they got the
        signal too)."""
        deadline = time.monotonic() + within_s
        while self.ray_alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def leftovers(self) -> list[psutil.Process]:
        alive = [p for pid, p in self.seen.items() if pid != self._reaper_pid and _alive(p)]
        if self.haproxy_configs:  # reparented ones are no descendants any more
            for p in psutil.process_iter():
                if p.pid not in self.seen and _haproxy_config(p) in self.haproxy_configs:
                    alive.append(p)
        try:
            alive += [p for p in self.me.children(recursive=True) if p.pid not in self.seen]
        except psutil.Error:
            pass
        return alive

    def reap(self, timeout_s: float = 2.0) -> list[str]:
        """Terminates what is left (SIGTERM, then SIGKILL); returns their command names."""
        procs = self.leftovers()
        names = []
        for p in procs:
            try:
                names.append(p.name())
                p.terminate()
            except psutil.Error:
                pass
        _, still = psutil.wait_procs(procs, timeout=timeout_s)
        for p in still:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(still, timeout=timeout_s)
        return names


def reaper_main(read_fd: int) -> None:
    """The reaper: collects what the command's tracker saw until the command is gone (EOF on the
    pipe), then ends whatever of it is still running."""
    tracker = ProcessTracker(me=psutil.Process())  # its own descendants: none
    with os.fdopen(read_fd) as pipe:
        for line in pipe:
            seen = json.loads(line)
            tracker.haproxy_configs.update(seen["configs"])
            for pid, created in seen["pids"]:
                try:
                    p = psutil.Process(pid)
                    if abs(p.create_time() - created) < 0.01:  # not a reused pid
                        tracker.seen[pid] = p
                except psutil.Error:
                    pass
    time.sleep(1.0)  # a command that stops cleanly ends them itself
    tracker.reap()


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def _parent(p: psutil.Process) -> int | None:
    try:
        return p.ppid()
    except psutil.Error:
        return None


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _haproxy_config(p: psutil.Process) -> str | None:
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return None
    if not cmd or not cmd[0].endswith("haproxy") or "-f" not in cmd:
        return None
    i = cmd.index("-f")
    return cmd[i + 1] if i + 1 < len(cmd) else None


def drain(app_name: str, grace_s: float, interrupted: Callable[[], bool]) -> None:
    """Raises the draining flag and waits (up to grace_s, or a second signal) until no engine
    holds a request."""
    from replicas.status_board import STALE_AFTER_S, get_board
    try:
        board = get_board(app_name)
        _await(board.set_draining.remote(True), 5.0)
    except Exception as exc:  # Ray is already going (its processes got the signal too)
        logger.warning("could not drain (%s); stopping at once", type(exc).__name__)
        return
    deadline = time.monotonic() + grace_s
    # the ingresses read the flag within a report period; then in-flight work is what is left
    time.sleep(min(1.0, grace_s))
    while time.monotonic() < deadline and not interrupted():
        try:
            reports = _await(board.read.remote(), 5.0)[0]
        except Exception:
            return
        now = time.time()
        busy = sum(stats["num_running"] + stats["num_waiting"]
                   for replicas in reports.values() for t, stats in replicas.values()
                   if now - t <= STALE_AFTER_S)
        if busy == 0:
            return
        time.sleep(0.25)


def _await(ref: Any, timeout_s: float) -> Any:
    import ray
    return ray.get(ref, timeout=timeout_s)


def run_with_timeout(fn: Callable[[], Any], timeout_s: float) -> bool:
    """fn() on a daemon thread; False when it did not finish in time (it is left behind)."""
    done = threading.Event()

    def target() -> None:
        try:
            fn()
        except Exception as exc:  # a half-dead cluster: the reaping below still runs
            logger.warning("shutdown step failed: %s", exc)
        finally:
            done.set()
    threading.Thread(target=target, daemon=True).start()
    return done.wait(timeout_s)
