"""The process main of one chat-template worker (serve_app/template_sandbox.py starts and kills it).

A fresh interpreter that imports only transformers' Jinja helpers (no torch, no FastAPI), caps its
own address space, then renders jobs from its parent until EOF, one at a time. The rendering is
transformers' own `render_jinja_template` (the sandboxed environment and the extras
`apply_chat_template` gives a template), with one change: the compiled template streams
(`Template.generate`) and stops as soon as the output passes `max_chars`, so a loop that would
print gigabytes ends at the limit instead of filling the worker's memory first.

Replies: ("ok", text), ("too_large", None), ("error", message)."""

from __future__ import annotations

import os
import resource
from typing import Any

from structured.worker_process import connect


class _TooLarge(Exception):
    pass


class _Capped:
    """A compiled Jinja template whose render() gives up past `max_chars`."""

    def __init__(self, template: Any, max_chars: int) -> None:
        self.template = template
        self.max_chars = max_chars

    def render(self, **variables: Any) -> str:
        pieces, size = [], 0
        for piece in self.template.generate(**variables):
            size += len(piece)
            if size > self.max_chars:
                raise _TooLarge()
            pieces.append(piece)
        return "".join(pieces)


def main(read_fd: int, write_fd: int, max_chars: int, max_memory_bytes: int) -> None:
    # below the engine and the ingress in the CPU's queue: a runaway template, or a replacement
    # worker importing transformers, takes only the CPU they leave
    os.nice(10)
    from transformers.utils import chat_template_utils

    inbox, outbox = connect(read_fd, write_fd)  # a killed ingress leaves no render running
    # render_jinja_template compiles through this module-level name: wrapping it here (this
    # process renders nothing else) keeps every other step of transformers' rendering as it is
    compile_template = chat_template_utils._compile_jinja_template
    chat_template_utils._compile_jinja_template = (
        lambda source: _Capped(compile_template(source), max_chars))
    if max_memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (max_memory_bytes, max_memory_bytes))
    outbox.send(("ready", None))
    while True:
        try:
            job = inbox.recv()
        except (EOFError, OSError):
            return
        outbox.send(_render(chat_template_utils.render_jinja_template, job, max_chars))


def _render(render_jinja_template: Any, job: dict[str, Any], max_chars: int) -> tuple[str, Any]:
    try:
        rendered, _ = render_jinja_template(
            conversations=[job["messages"]], chat_template=job["chat_template"],
            tools=job["tools"], documents=job["documents"],
            add_generation_prompt=job["add_generation_prompt"],
            continue_final_message=job["continue_final_message"], **job["variables"])
    except _TooLarge:
        return ("too_large", None)
    except MemoryError:
        return ("error", "the template needs more memory than allowed")
    except Exception as exc:  # noqa: BLE001 (anything the template does is the client's 400)
        return ("error", f"{type(exc).__name__}: {exc}")
    text = rendered[0]
    # a backstop, should transformers ever compile by another name than the one wrapped above
    return ("too_large", None) if len(text) > max_chars else ("ok", text)
