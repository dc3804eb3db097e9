"""Async streaming client for OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions``:
sends one ``BenchRequest`` and measures it into a ``RequestOutcome``.

Timing follows ``vllm bench serve``: TTFT is the first chunk carrying content, each later content
chunk adds inter-token latencies, E2E latency ends at the last content chunk. Token counts come
from the final usage chunk (``stream_options.include_usage``); per-chunk counts come from
``continuous_usage_stats`` when enabled, otherwise multi-token chunks are split evenly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from benchmarks.datasets import BenchRequest
from benchmarks.records import RequestOutcome

Api = Literal["chat", "completions"]


def infer_api(endpoint: str) -> Api:
    """``.../chat/completions`` speaks the chat API; any other path the completions API."""
    return "chat" if endpoint.rstrip("/").endswith("chat/completions") else "completions"


@dataclass(frozen=True)
class ClientConfig:
    """Where to send and how to shape every request body."""

    base_url: str
    model: str
    endpoint: str = "/v1/chat/completions"
    api: Api | None = None  # None: inferred from ``endpoint``
    api_key: str | None = None
    ignore_eos: bool = False
    continuous_usage_stats: bool = False
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0

    @property
    def resolved_api(self) -> Api:
        return self.api or infer_api(self.endpoint)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")


def build_payload(config: ClientConfig, request: BenchRequest) -> dict[str, Any]:
    """The JSON body for ``request``. Order of precedence: defaults < request's extra body <
    the user's ``--extra-body`` (so a user can override anything)."""
    payload: dict[str, Any] = {
        "model": config.model,
        "max_tokens": request.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.continuous_usage_stats:
        payload["stream_options"]["continuous_usage_stats"] = True
    if config.resolved_api == "chat":
        payload["messages"] = request.chat_messages()
    else:
        payload["prompt"] = request.prompt
    # Constrained requests must be free to stop when their grammar completes.
    if config.ignore_eos and request.fixed_output:
        payload["ignore_eos"] = True
    payload.update(request.extra_body)
    payload.update(config.extra_body)
    return payload


def split_gaps(
    times: Sequence[float],
    chunk_tokens: Sequence[int] | None,
    output_tokens: int,
) -> tuple[float, ...]:
    """Inter-token latencies from content-chunk arrival ``times``.

    With ``chunk_tokens`` (tokens per chunk, from continuous usage stats) a chunk of k tokens
    contributes k equal parts of its gap; a chunk of 0 new tokens (text held back earlier) folds
    its gap into the next one. Without them, ``output_tokens - 1`` tokens are spread evenly over
    the gaps when the server sent fewer chunks than tokens. Either way the ITLs sum to
    ``times[-1] - times[0]`` (up to a trailing 0-token chunk).
    """
    gaps = [b - a for a, b in zip(times, times[1:])]
    if not gaps:
        return ()
    if chunk_tokens is not None:
        counts = list(chunk_tokens[1:])
    elif output_tokens - 1 > len(gaps):
        n = output_tokens - 1
        # floor((i+1)*n/g) - floor(i*n/g): integer counts summing to n, spread evenly.
        counts = [(i + 1) * n // len(gaps) - i * n // len(gaps) for i in range(len(gaps))]
    else:
        counts = [1] * len(gaps)

    itl: list[float] = []
    carry = 0.0
    for gap, k in zip(gaps, counts):
        if k <= 0:
            carry += gap
            continue
        part = (gap + carry) / k
        carry = 0.0
        itl.extend([part] * k)
    return tuple(itl)


def _chunk_text(chunk: Mapping[str, Any], api: Api) -> str:
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], Mapping):
        return ""
    choice = choices[0]
    if api == "completions":
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    # Reasoning models stream thoughts in a separate field; those are output tokens too.
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


def _error_text(chunk: Mapping[str, Any]) -> str:
    err = chunk.get("error")
    if isinstance(err, Mapping):
        return str(err.get("message") or err)
    return str(err)


class StreamingClient:
    """Sends ``BenchRequest``s over one pooled ``httpx.AsyncClient``. Use as an async context
    manager, or call ``aclose``. Never raises for a failed request: failures are outcomes."""

    def __init__(self, config: ClientConfig, http: httpx.AsyncClient | None = None) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        # No connection cap: the runner decides concurrency, the pool must not queue requests.
        # trust_env=False so proxy variables cannot silently put a hop between us and the server.
        self._http = http or httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(config.timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            trust_env=False,
        )

    async def __aenter__(self) -> StreamingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def send(self, request: BenchRequest) -> RequestOutcome:
        api = self.config.resolved_api
        payload = build_payload(self.config, request)
        times: list[float] = []
        texts: list[str] = []
        chunk_tokens: list[int] = []
        seen_completion = 0
        per_chunk_known = True  # until a content chunk arrives without a cumulative count
        usage: Mapping[str, Any] | None = None
        error = ""

        start = time.perf_counter()
        try:
            async with self._http.stream("POST", self.config.url, json=payload) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode("utf-8", errors="replace")
                    error = f"HTTP {response.status_code}: {body[:2000]}"
                else:
                    async for line in response.aiter_lines():
                        now = time.perf_counter()
                        if not line.startswith("data:"):
                            continue  # blank separators, ": keep-alive" comments, event:/id: fields
                        data = line[5:].strip()
                        if data == "[DONE]":
                            continue
                        chunk = json.loads(data)
                        if "error" in chunk:
                            error = _error_text(chunk)
                            break
                        raw_usage = chunk.get("usage")
                        chunk_usage = raw_usage if isinstance(raw_usage, Mapping) else None
                        if chunk_usage is not None:
                            usage = chunk_usage
                        # Cumulative count on this chunk: present on every chunk only with
                        # continuous usage stats (or servers that always send it).
                        cumulative = chunk_usage.get("completion_tokens") if chunk_usage else None
                        text = _chunk_text(chunk, api)
                        if text:
                            times.append(now)
                            texts.append(text)
                            if isinstance(cumulative, int):
                                chunk_tokens.append(cumulative - seen_completion)
                            else:
                                per_chunk_known = False
                        if isinstance(cumulative, int):
                            seen_completion = cumulative
        except Exception as exc:  # any transport/protocol failure is this request's outcome
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

        if not error and not times:
            error = "stream ended without any content"
        usage_tokens = (usage or {}).get("completion_tokens")
        usage_reported = isinstance(usage_tokens, int)
        if isinstance(usage_tokens, int):
            output_tokens = usage_tokens
        elif per_chunk_known:
            output_tokens = sum(chunk_tokens)
        else:
            output_tokens = len(times)
        prompt_tokens = (usage or {}).get("prompt_tokens")
        prompt_len = prompt_tokens if isinstance(prompt_tokens, int) else request.prompt_len

        if error:
            return RequestOutcome(
                success=False,
                prompt_len=prompt_len,
                output_tokens=output_tokens,
                expected_output_len=request.output_len,
                latency=time.perf_counter() - start,
                start_time=start,
                error=error,
                generated_text="".join(texts),
                usage_reported=usage_reported,
                kind=request.kind,
            )
        return RequestOutcome(
            success=True,
            prompt_len=prompt_len,
            output_tokens=output_tokens,
            expected_output_len=request.output_len,
            ttft=times[0] - start,
            itl=split_gaps(times, chunk_tokens if per_chunk_known else None, output_tokens),
            event_gaps=tuple(b - a for a, b in zip(times, times[1:])),
            latency=times[-1] - start,
            start_time=start,
            generated_text="".join(texts),
            usage_reported=usage_reported,
            kind=request.kind,
        )


async def first_model(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The first model id listed by ``GET /v1/models``, for when ``--model`` is not given."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=timeout_s, trust_env=False) as http:
        response = await http.get(base_url.rstrip("/") + "/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no models; pass --model")
    return str(models[0]["id"])
