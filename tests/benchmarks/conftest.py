"""A tiny fake OpenAI-style streaming server, only for testing the benchmark client's SSE
parsing and timing. Behaviour is steered per request by ``fake_*`` body fields."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    return len(str(body.get("prompt", "")).split())


class Load:
    """Streams the fake server is sending now, and the most it sent at once."""

    def __init__(self) -> None:
        self.in_flight = self.peak = 0


def _make_app(payloads: list[dict[str, Any]], load: Load) -> Starlette:
    async def stream(request: Request) -> Any:
        body = await request.json()
        payloads.append(body)
        chat = request.url.path.endswith("chat/completions")
        if "fake_status" in body:
            return JSONResponse({"error": {"message": "fake failure"}}, status_code=int(body["fake_status"]))
        n = int(body.get("max_tokens", 4))
        per_chunk = int(body.get("fake_tokens_per_chunk", 1))
        delay = float(body.get("fake_delay_s", 0.01))
        opts = body.get("stream_options") or {}
        continuous = bool(opts.get("continuous_usage_stats"))
        prompt_tokens = _prompt_tokens(body)

        def usage(done: int) -> dict[str, int]:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}

        def event(choices: list[dict[str, Any]], done: int | None) -> str:
            chunk: dict[str, Any] = {"id": "x", "object": "chunk", "model": body.get("model"), "choices": choices}
            if continuous and done is not None:
                chunk["usage"] = usage(done)
            return f"data: {json.dumps(chunk)}\n\n"

        async def gen() -> AsyncIterator[str]:
            load.in_flight += 1
            load.peak = max(load.peak, load.in_flight)
            try:
                async for event_text in events():
                    yield event_text
            finally:
                load.in_flight -= 1

        async def events() -> AsyncIterator[str]:
            if chat:  # vllm-style role chunk without content: must not count as the first token
                yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}}], 0)
            done = 0
            while done < n:
                await asyncio.sleep(delay)
                k = min(per_chunk, n - done)
                text = "".join(f"t{done + i} " for i in range(k))
                done += k
                if body.get("fake_error_after") is not None and done > int(body["fake_error_after"]):
                    yield f"data: {json.dumps({'error': {'message': 'boom midstream'}})}\n\n"
                    return
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                yield event([choice], done)
            yield ": keep-alive comment\n\n"
            if opts.get("include_usage") and not body.get("fake_no_usage"):
                yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage(done)})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", stream, methods=["POST"]),
            Route("/v1/completions", stream, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )


class FakeServer:
    def __init__(self) -> None:
        self.payloads: list[dict[str, Any]] = []
        self.load = Load()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(_make_app(self.payloads, self.load), log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="session")
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def free_port_url() -> str:
    """A URL on which nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
