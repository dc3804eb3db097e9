"""`bench soak`: many requests through a running server while the resident memory of its Ray Serve
processes on this node is sampled; reports each process's RSS after the warm-up and at the end.

The KV cache is preallocated to its budget when a replica starts, so a replica's RSS should stay
flat however many requests pass through it; growth here means something keeps per-request state.
Requests mix what allocates per request: streaming and not, n=2, logprobs, stop strings, JSON
schemas and clients that disconnect mid-stream."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from tqdm import tqdm

from benchmarks.client import first_model

PROCESS_MARKERS = ("ServeReplica", "ProxyActor")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--num-warmups", type=int, default=500,
                   help="requests before the first RSS reading (allocators settle)")
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--api-key", default=None)
    p.add_argument("--sample-every-s", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", type=Path)


@dataclass
class Sample:
    t: float
    rss_mib: dict[str, float]


def serve_processes() -> dict[str, psutil.Process]:
    """This node's Ray Serve replica and proxy processes, keyed 'name (pid)'."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        for marker in PROCESS_MARKERS:
            if f"ray::{marker}" in cmdline:
                found[f"{cmdline.split()[0]} ({proc.info['pid']})"] = proc
    return found


def rss_mib(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, proc in procs.items():
        try:
            out[name] = proc.memory_info().rss / 2**20
        except psutil.Error:  # the process went away (a replica replaced)
            out[name] = float("nan")
    return out


def request_body(model: str, i: int, rng: random.Random, max_tokens: int) -> dict[str, Any]:
    """Request i of the mix (`bench soak`'s and `bench chaos`'s): plain, n=2, logprobs, a stop
    string and a JSON schema in turn, each with a prompt of its own."""
    words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "river", "stone"))
                     for _ in range(rng.randint(4, 40)))
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.8,
                            "seed": i, "messages": [{"role": "user", "content": f"{i}: {words}"}]}
    kind = i % 5
    if kind == 1:
        body["n"] = 2
    elif kind == 2:
        body |= {"logprobs": True, "top_logprobs": 3}
    elif kind == 3:
        body["stop"] = ["a"]
    elif kind == 4:  # a guide per request
        schema = {"type": "object", "required": ["a", "b"],
                  "properties": {"a": {"type": "integer"},
                                 "b": {"type": "string", "maxLength": 8}}}
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "pair", "schema": schema}}
    return body


@dataclass
class Outcome:
    """One request as its client saw it: the status, an error (a non-200's body, or an SSE
    error event's), whether it ended whole (a stream with [DONE]) or was left on purpose, and
    when it started and ended (s)."""

    start: float
    end: float = 0.0
    status: int | None = None
    error: str | None = None
    done: bool = False
    disconnected: bool = False
    exception: str | None = None

    @property
    def ok(self) -> bool:
        return (self.status == 200 and self.error is None and self.exception is None
                and (self.done or self.disconnected))


async def attempt(client: httpx.AsyncClient, url: str, body: dict[str, Any], stream: bool,
                  disconnect: bool, clock: Callable[[], float] = time.perf_counter) -> Outcome:
    """Sends one request; `disconnect`: a stream left after its first chunk (the server must
    free what it held)."""
    out = Outcome(clock())
    try:
        if not stream:
            r = await client.post(url, json=body)
            out.status, out.done = r.status_code, True
            if r.status_code != 200:
                out.error = r.text[:300]
        else:
            async with client.stream("POST", url, json=body | {"stream": True}) as r:
                out.status = r.status_code
                if r.status_code != 200:
                    out.error = (await r.aread()).decode(errors="replace")[:300]
                else:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and line[6:20].replace(" ", "").startswith(
                                '{"error"'):
                            out.error = line[6:306]
                        elif line == "data: [DONE]":
                            out.done = True
                        elif disconnect and line.startswith("data: {"):
                            out.disconnected = True
                            break
    except httpx.HTTPError as exc:
        out.exception = repr(exc)[:200]
    out.end = clock()
    return out


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or await first_model(args.base_url, args.api_key)
    url = args.base_url.rstrip("/") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency)
    failures = 0

    async def send(client: httpx.AsyncClient, i: int, progress: tqdm) -> None:
        nonlocal failures
        async with limit:
            out = await attempt(client, url, request_body(model, i, rng, args.max_tokens),
                                stream=i % 2 == 0, disconnect=i % 10 == 4)
        failures += not out.ok
        progress.update(1)

    procs = serve_processes()
    if not procs:
        raise RuntimeError("no Ray Serve processes on this node: run the soak on the server's node")
    samples: list[Sample] = []
    start = time.perf_counter()

    async def sampler() -> None:
        while True:
            samples.append(Sample(time.perf_counter() - start, rss_mib(procs)))
            await asyncio.sleep(args.sample_every_s)

    timeout = httpx.Timeout(300.0)
    limits = httpx.Limits(max_connections=args.max_concurrency * 2)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        with tqdm(total=args.num_warmups, desc="warm-up", unit="req") as progress:
            await asyncio.gather(*(send(client, -1 - i, progress)
                                   for i in range(args.num_warmups)))
        before = rss_mib(procs)
        task = asyncio.create_task(sampler())
        with tqdm(total=args.num_requests, desc="soak", unit="req") as progress:
            await asyncio.gather(*(send(client, i, progress) for i in range(args.num_requests)))
        task.cancel()
        after = rss_mib(procs)
    elapsed = time.perf_counter() - start
    return {"model": model, "num_requests": args.num_requests, "failures": failures,
            "elapsed_s": elapsed, "rss_mib_after_warmup": before, "rss_mib_end": after,
            "rss_growth_mib": {k: after[k] - before[k] for k in before},
            "max_rss_mib": {k: max(s.rss_mib[k] for s in samples) for k in before},
            "samples": [{"t": s.t, "rss_mib": s.rss_mib} for s in samples]}


def run_cli(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(_run(args))
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{result['num_requests']} requests in {result['elapsed_s']:.0f} s, "
          f"{result['failures']} failed (disconnects count as successes)")
    print(f"{'process':60s} {'after warm-up':>14s} {'end':>10s} {'growth':>10s} {'max':>10s}")
    for name, before in result["rss_mib_after_warmup"].items():
        print(f"{name:60s} {before:11.1f} MiB {result['rss_mib_end'][name]:7.1f} MiB "
              f"{result['rss_growth_mib'][name]:+7.1f} MiB {result['max_rss_mib'][name]:7.1f} MiB")
    if args.result_json:
        args.result_json.write_text(json.dumps(result, indent=2))
        print(f"results written to {args.result_json}")
    return 0 if result["failures"] == 0 else 1
