"""`bench caps`: what one request at the per-request list caps costs the other streams.

Against a live server: the TPOT of `--streams` streams alone, then beside one request that sends
every capped list at its limit (`all`), then beside one request with each list alone at its limit;
alone and beside rounds alternate, and each figure is the median over rounds of the streams'
median TPOT. The capped request starts first and is decoding (its lists parsed, tokenized and
turned into tensors) before the streams start, and it outlasts them, so what the streams see is
the per-step and per-token cost of its lists. A `plain` case, the same request without lists,
separates that cost from the cost of one more stream."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import string
import time
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.client import first_model
from serve_app.protocol import (MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_STOP,
                                MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS)

LISTS = ("bad_words", "logit_bias", "allowed_token_ids", "stop", "stop_token_ids")
CASES = ("plain", "all", *LISTS)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256,
                   help="tokens per stream (ignore_eos); long enough to span many steps (the "
                        "request beside them asks for twice as many and 32 more: the model's "
                        "context must hold those and the prompt)")
    p.add_argument("--rounds", type=int, default=3, help="alone/beside pairs per case")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="default: found by asking the server's /detokenize")


def parse_cases(text: str) -> tuple[str, ...]:
    cases = tuple(c.strip() for c in text.split(",") if c.strip())
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise ValueError(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    return cases


def capped_fields(case: str, vocab_size: int) -> dict[str, Any]:
    """The request fields of `case` at their caps (`plain`: none), made so that the request
    still runs to its max_tokens: every token allowed, biases small, the stop strings unlikely
    in any output, and min_tokens holds the stop token ids off (banning them every step)."""
    rng = random.Random(0)
    fields: dict[str, Any] = {}
    if case in ("all", "bad_words"):
        # multi-token words (their prefixes are walked every step), short enough that both
        # spellings of all of them stay within the tokens the server keeps for bad words
        fields["bad_words"] = ["zq" + "".join(rng.choices(string.ascii_lowercase, k=3))
                               for _ in range(MAX_BAD_WORDS)]
    if case in ("all", "logit_bias"):
        fields["logit_bias"] = {str(t): rng.choice((-0.5, 0.5))
                                for t in range(min(MAX_LOGIT_BIAS, vocab_size))}
    if case in ("all", "allowed_token_ids"):
        fields["allowed_token_ids"] = [i % vocab_size for i in range(MAX_ALLOWED_TOKEN_IDS)]
    if case in ("all", "stop"):
        fields["stop"] = ["".join(rng.choices(string.ascii_letters + " ", k=MAX_STOP_CHARS))
                          for _ in range(MAX_STOP)]
    if case in ("all", "stop_token_ids"):
        fields["stop_token_ids"] = [i % vocab_size for i in range(MAX_STOP_TOKEN_IDS)]
    return fields


@dataclass(frozen=True)
class Stream:
    tpot_s: float | None  # None: fewer than two tokens came
    started: float
    ended: float
    text: str = ""
    usage: dict[str, Any] | None = None


async def stream_chat(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                      first_token: asyncio.Event | None = None) -> Stream:
    """Streams one chat completion; TPOT from its first to its last content chunk over the
    tokens the usage report counts."""
    started = time.perf_counter()
    times: list[float] = []
    tokens = 0
    parts: list[str] = []
    usage = None
    async with http.stream("POST", url, json={**body, "stream": True,
                                              "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
                tokens = usage["completion_tokens"]
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                times.append(time.perf_counter())
                parts.append(choices[0]["delta"]["content"])
                if first_token is not None:
                    first_token.set()
    ended = time.perf_counter()
    tpot = (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else None
    return Stream(tpot, started, ended, "".join(parts), usage)


def _stream_body(model: str, i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.8,
            "seed": i, "messages": [{"role": "user", "content": f"Stream {i}: tell a story."}]}


async def measure_round(http: httpx.AsyncClient, base_url: str, model: str, streams: int,
                        max_tokens: int, beside: dict[str, Any] | None) -> float:
    """The median TPOT (s) of `streams` streams, alone (`beside` None) or while a request with
    the fields `beside` decodes next to them."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    background = None
    if beside is not None:
        first = asyncio.Event()
        # twice as long as the streams (and 32 tokens more), cancelled once they end: it
        # decodes beside them however late they start on a loaded machine (a margin of 32
        # steps alone was not enough, half as long again once in a clean-clone suite)
        body = {**_stream_body(model, -1, 2 * max_tokens + 32), **beside}
        if "stop_token_ids" in beside:
            body["min_tokens"] = body["max_tokens"]
        background = asyncio.ensure_future(stream_chat(http, url, body, first))
        waiter = asyncio.ensure_future(first.wait())
        await asyncio.wait({background, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if background.done():
            background.result()  # raises the server's refusal, if that was it
            raise RuntimeError("the request beside the streams ended before they started")
    results = await asyncio.gather(*(stream_chat(http, url, _stream_body(model, i, max_tokens))
                                     for i in range(streams)))
    if background is not None:
        if background.done():
            raise RuntimeError("the request beside the streams ended before they did")
        background.cancel()  # the client leaves; the server aborts it
        with contextlib.suppress(asyncio.CancelledError):
            await background
    tpots = [r.tpot_s for r in results if r.tpot_s is not None]
    if not tpots:
        raise RuntimeError("no stream produced two tokens")
    return statistics.median(tpots)


async def vocab_size_of(http: httpx.AsyncClient, base_url: str, model: str) -> int:
    """The smallest token id /detokenize refuses (binary search)."""
    url = base_url.rstrip("/") + "/detokenize"

    async def known(token: int) -> bool:
        r = await http.post(url, json={"model": model, "tokens": [token]})
        return r.status_code == 200

    lo, hi = 0, 1
    while await known(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if await known(mid) else (lo, mid)
    return hi


@dataclass(frozen=True)
class CaseResult:
    case: str
    alone_s: list[float]
    beside_s: list[float]

    @property
    def ratio(self) -> float:
        return statistics.median(self.beside_s) / statistics.median(self.alone_s)


async def run(args: argparse.Namespace) -> list[CaseResult]:
    cases = parse_cases(args.cases)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or await first_model(args.base_url, args.api_key)
    async with httpx.AsyncClient(headers=headers, timeout=600, trust_env=False,
                                 limits=httpx.Limits(max_connections=None)) as http:
        vocab = args.vocab_size or await vocab_size_of(http, args.base_url, model)
        measure = lambda beside: measure_round(  # noqa: E731
            http, args.base_url, model, args.streams, args.max_tokens, beside)
        await measure(None)  # warm-up: the prompts' prefix cache, the first steps' allocations
        out = []
        for case in cases:
            fields = capped_fields(case, vocab)
            alone, beside = [], []
            for _ in range(args.rounds):
                alone.append(await measure(None))
                beside.append(await measure(fields))
            out.append(CaseResult(case, alone, beside))
    return out


def report(results: list[CaseResult], streams: int) -> str:
    """One line per case; `vs plain` divides its ratio by the plain case's, leaving the cost of
    the lists without that of one more stream."""
    plain = next((r.ratio for r in results if r.case == "plain"), None)
    lines = [f"{'beside':<20}{'TPOT alone ms':>15}{'TPOT beside ms':>16}{'ratio':>8}"
             f"{'vs plain' if plain else '':>10}   ({streams} streams, median of rounds)"]
    for r in results:
        lines.append(f"{r.case:<20}{statistics.median(r.alone_s) * 1e3:>15.2f}"
                     f"{statistics.median(r.beside_s) * 1e3:>16.2f}{r.ratio:>8.3f}"
                     + (f"{r.ratio / plain:>10.3f}" if plain else ""))
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    try:
        parse_cases(args.cases)
    except ValueError as exc:
        print(exc)
        return 2
    print(report(asyncio.run(run(args)), args.streams))
    return 0
