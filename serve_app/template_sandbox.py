"""Per-request chat templates, rendered in killable worker processes under a time, size and memory
limit.

A template is a program: `{% for i in range(100000) %}{% for j in range(100000) %}` runs for hours,
`{{ 'x' * 10**10 }}` asks for 10 GB, and Jinja cannot be interrupted from outside the thread running
it (which would also hold the GIL the whole time). So a request's own `chat_template` (accepted only
with `--trust-request-chat-template`, as vLLM) renders in a small pool of worker processes: fresh
interpreters that import only transformers' Jinja helpers (no torch), each under an address-space
cap. A render that passes its time limit (counted from the request, waiting for a worker included)
gets its worker killed and replaced; one whose output passes the size limit or that fails is a 400.
The rendering is transformers' own (`render_jinja_template`, the sandboxed environment
`apply_chat_template` uses), so a template renders here exactly as it would as the model's."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from serve_app.errors import APIError

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _serve(read_fd: int, write_fd: int, max_memory_bytes: int) -> None:
    """Worker main: render jobs until EOF; exits with its parent."""
    import resource

    from transformers.utils.chat_template_utils import render_jinja_template

    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    parent = os.getppid()

    def exit_with_parent() -> None:  # a killed ingress must not leave a render running
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    if max_memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (max_memory_bytes, max_memory_bytes))
    outbox.send(("ready", None))
    while True:
        try:
            job = inbox.recv()
        except (EOFError, OSError):
            return
        try:
            rendered, _ = render_jinja_template(conversations=[job["messages"]], **job["kwargs"])
            text = rendered[0]
            if len(text) > job["max_chars"]:
                outbox.send(("too_large", len(text)))
            else:
                outbox.send(("ok", text))
        except MemoryError:
            outbox.send(("error", "the template needs more memory than allowed"))
        except Exception as exc:  # noqa: BLE001 (anything the template does is the client's 400)
            outbox.send(("error", f"{type(exc).__name__}: {exc}"))


@dataclass(eq=False)
class _Worker:
    process: subprocess.Popen
    inbox: Connection
    outbox: Connection
    ready: bool = False

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=5)
        self.inbox.close()
        self.outbox.close()


class _TimedOut(Exception):
    pass


@dataclass
class TemplateSandbox:
    processes: int = 2
    timeout_s: float = 5.0
    max_chars: int = 4 * 2**20
    max_memory_mb: int = 1024
    _idle: list[_Worker] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: ThreadPoolExecutor | None = None

    async def render(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """transformers' rendering of `messages` with kwargs (chat_template, tools, documents,
        add_generation_prompt, continue_final_message, template variables)."""
        if self._threads is None:
            self._threads = ThreadPoolExecutor(self.processes, thread_name_prefix="template")
        deadline = time.monotonic() + self.timeout_s
        job = {"messages": messages, "kwargs": kwargs, "max_chars": self.max_chars}
        loop = asyncio.get_running_loop()
        try:
            status, payload = await loop.run_in_executor(self._threads, self._run, job, deadline)
        except _TimedOut:
            raise APIError(f"the chat template took longer than {self.timeout_s:g} s to render",
                           param="chat_template") from None
        if status == "ok":
            return payload
        if status == "too_large":
            raise APIError(f"the chat template rendered {payload} characters, more than the "
                           f"{self.max_chars} allowed", param="chat_template")
        raise APIError(f"chat template error: {payload}", param="chat_template")

    def _spawn(self) -> _Worker:
        to_worker_r, to_worker_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        code = (f"from serve_app.template_sandbox import _serve; "
                f"_serve({to_worker_r}, {to_parent_w}, {self.max_memory_mb * 2**20})")
        try:
            process = subprocess.Popen([sys.executable, "-c", code], env=env,
                                       pass_fds=(to_worker_r, to_parent_w),
                                       stdin=subprocess.DEVNULL)
        finally:
            os.close(to_worker_r)
            os.close(to_parent_w)
        return _Worker(process, Connection(to_worker_w, readable=False),
                       Connection(to_parent_r, writable=False))

    def _run(self, job: dict[str, Any], deadline: float) -> tuple[str, Any]:
        """On a pool thread (at most `processes` at once): one job on one worker."""
        if time.monotonic() >= deadline:  # its time went by waiting for a worker
            raise _TimedOut()
        with self._lock:
            worker = self._idle.pop() if self._idle else self._spawn()
        try:
            if not worker.ready:  # a fresh interpreter: its start is not the template's time
                starting = time.monotonic()
                if not worker.outbox.poll(60.0):
                    raise _TimedOut()
                worker.outbox.recv()
                worker.ready = True
                deadline += time.monotonic() - starting
            worker.inbox.send(job)
            if not worker.outbox.poll(max(0.0, deadline - time.monotonic())):
                raise _TimedOut()
            result = worker.outbox.recv()
        except (_TimedOut, EOFError, OSError) as exc:
            worker.kill()
            if isinstance(exc, _TimedOut):
                raise
            return ("error", "the template's worker died (out of memory?)")
        with self._lock:
            self._idle.append(worker)
        return result

    def close(self) -> None:
        with self._lock:
            workers, self._idle = self._idle, []
        for worker in workers:
            worker.kill()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
