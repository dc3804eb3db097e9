"""The ingress's work before a request reaches a replica, off its event loop.

Parsing a body, rendering a chat template, tokenizing, bad-word tokenization and the cheap
constraint checks take from microseconds to (for a 4 MiB body) tens of milliseconds each; on the
event loop every one of them would stall `/health` and every other stream for that long. They run
on a small thread pool instead (the tokenizers' Rust code releases the GIL), and a request's own
chat template, which is a program, runs in the killable processes of serve_app/template_sandbox.py,
refused unless the server trusts per-request templates (`--trust-request-chat-template`, vLLM's
flag and default)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from serve_app import chat
from serve_app.config import AppConfig
from serve_app.errors import APIError
from serve_app.template_sandbox import TemplateSandbox

T = TypeVar("T")
THREADS = 4


class Preprocessor:
    def __init__(self, config: AppConfig) -> None:
        self.trust_request_templates = config.trust_request_chat_template
        self._threads = ThreadPoolExecutor(THREADS, thread_name_prefix="preprocess")
        self.sandbox = TemplateSandbox(timeout_s=config.chat_template_timeout_s,
                                       max_chars=config.max_rendered_prompt_chars)
        if self.trust_request_templates:  # never a worker process without the flag
            self.sandbox.start()

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on a preprocessing thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, functools.partial(fn, *args, **kwargs))

    async def render(self, tokenizer: Any, messages: list[dict[str, Any]], *,
                     chat_template: str | None = None, add_special_tokens: bool = False,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     template_kwargs: dict[str, Any] | None = None,
                     tools: list[dict] | None = None, documents: list[dict] | None = None,
                     client: str | None = None) -> chat.RenderedPrompt:
        """Messages -> prompt text and token ids, with the model's template or the request's
        (`client`, as auth.client_id names it, gets its turn in the template workers)."""
        args = {"tools": tools, "documents": documents,
                "add_generation_prompt": add_generation_prompt,
                "continue_final_message": continue_final_message}
        if chat_template is None:
            return await self.run(chat.render, tokenizer, messages, **args,
                                  add_special_tokens=add_special_tokens,
                                  template_kwargs=template_kwargs)
        if not self.trust_request_templates:
            raise APIError("a per-request chat_template is refused: this server renders only the "
                           "model's own template unless started with "
                           "--trust-request-chat-template", param="chat_template")
        chat.check_render_args(messages, add_generation_prompt, continue_final_message)
        # as apply_chat_template: the special tokens, which the request's kwargs may override
        variables = {**tokenizer.special_tokens_map, **chat.template_variables(template_kwargs)}
        text = await self.sandbox.render(messages, chat_template=chat_template, **args,
                                         variables=variables, client=client)
        ids = await self.run(tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return chat.RenderedPrompt(text, list(ids))

    def close(self) -> None:
        self.sandbox.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
