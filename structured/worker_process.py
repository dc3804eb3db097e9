"""A killable worker process spoken to over a pair of pipes: the plumbing shared by the
constraint compiler's pool (structured/index_builder.py) and the chat-template sandbox
(serve_app/template_sandbox.py). It sits in structured/ because that is the lowest layer (it
imports neither replicas/ nor serve_app/), so both may use it.

A worker is a fresh interpreter running one function of ours: unlike multiprocessing's spawn it
never re-imports the parent's __main__ (a Ray worker's), and unlike fork it carries no threads,
torch, Ray or event-loop state. It dies with its parent, so a killed server leaves no compile or
render running for minutes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(eq=False)
class Worker:
    """The parent's side of one worker."""

    process: subprocess.Popen
    inbox: Connection  # parent -> worker
    outbox: Connection  # worker -> parent
    spawned: float = field(default_factory=time.monotonic)
    ready: bool = False  # the worker said it has started

    def started(self, timeout_s: float) -> bool:
        """Whether the worker has said it started, waiting up to `timeout_s` for that message
        (read once). Raises EOFError or OSError where it died first."""
        if not self.ready and self.outbox.poll(timeout_s):
            self.outbox.recv()
            self.ready = True
        return self.ready

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=5)
        self.inbox.close()
        self.outbox.close()


def spawn(target: str, *args: int | float | str) -> Worker:
    """Starts `module:function`, called in the worker as function(read_fd, write_fd, *args)."""
    module, function = target.split(":")
    to_worker_r, to_worker_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    call = ", ".join(repr(a) for a in (to_worker_r, to_parent_w, *args))
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", f"from {module} import {function}; {function}({call})"],
            env=env, pass_fds=(to_worker_r, to_parent_w), stdin=subprocess.DEVNULL)
    finally:
        os.close(to_worker_r)
        os.close(to_parent_w)
    return Worker(process, Connection(to_worker_w, readable=False),
                  Connection(to_parent_r, writable=False))


def connect(read_fd: int, write_fd: int) -> tuple[Connection, Connection]:
    """The worker's side: its (inbox, outbox); from now on it exits when its parent does."""
    parent = os.getppid()

    def exit_with_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    return Connection(read_fd, writable=False), Connection(write_fd, readable=False)
