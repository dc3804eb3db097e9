"""`bench burst`: N chat requests sent at once, while `/health` is polled from another process;
reports what a load balancer would see: the status counts, each status's latency (p50/max), /health's worst answer.

The client is aiohttp: httpx's connection pool spent ~18 ms of client CPU per request at 1,000
concurrent connections on the 2-core VM, which made the client, not the server, the bottleneck."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from benchmarks.client import first_model


@dataclass(frozen=True)
class Answer:
    status: int
    seconds: float
    body: dict[str, Any]
    retry_after: str | None


@dataclass
class BurstResult:
    answers: list[Answer]
    health_seconds: list[float] = field(default_factory=list)
    health_failures: int = 0
    elapsed_s: float = 0.0

    @property
    def counts(self) -> dict[int, int]:
        return dict(sorted(Counter(a.status for a in self.answers).items()))

    def summary(self) -> dict[str, Any]:
        by_status: dict[str, Any] = {}
        for status in self.counts:
            times = sorted(a.seconds for a in self.answers if a.status == status)
            by_status[str(status)] = {"count": len(times), "p50_s": statistics.median(times),
                                      "max_s": times[-1]}
        return {"requests": len(self.answers), "elapsed_s": self.elapsed_s,
                "by_status": by_status,
                "max_s": max((a.seconds for a in self.answers), default=0.0),
                "health_polls": len(self.health_seconds),
                "health_failures": self.health_failures,
                "health_worst_s": max(self.health_seconds, default=0.0)}


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Answer:
    started = time.monotonic()
    try:
        async with session.post(url, json=body) as r:
            text = await r.text()
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError:
                parsed = {"raw": text[:200]}
            return Answer(r.status, time.monotonic() - started, parsed,
                          r.headers.get("Retry-After"))
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Answer(0, time.monotonic() - started, {"raw": repr(exc)}, None)


def _poll_health(root: str, interval_s: float, ready: Any, stop: Any, out: Any) -> None:
    """A load balancer's probe, in a process of its own: a new connection per poll, timed
    apart from the burst's client (whose event loop, busy with thousands of connections,
    made its own polls look seconds slower than the server answered them)."""
    import httpx
    seconds, failures = [], 0
    while not stop.is_set():
        started = time.monotonic()
        try:
            ok = httpx.get(f"{root}/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            ok = False
        seconds.append(time.monotonic() - started)
        failures += not ok
        ready.set()
        stop.wait(interval_s)
    out.put((seconds, failures))


async def run_burst(base_url: str, n: int, model: str, max_tokens: int = 16,
                    health_interval_s: float = 0.2, timeout_s: float = 300.0,
                    api_key: str | None = None) -> BurstResult:
    """Sends n chat completions at once to `base_url` (…/v1) and polls /health meanwhile."""
    root = base_url.removesuffix("/").removesuffix("/v1")
    body = {"model": model, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Tell me a story about a burst."}]}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = BurstResult([])
    ctx = multiprocessing.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    prober = ctx.Process(target=_poll_health, args=(root, health_interval_s, ready, stop, out),
                         daemon=True)
    prober.start()
    await asyncio.to_thread(ready.wait, 60)  # polling before the burst starts
    connector = aiohttp.TCPConnector(limit=n)
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        url = f"{root}/v1/chat/completions"
        result.answers = await asyncio.gather(*(_one(session, url, body) for _ in range(n)))
    result.elapsed_s = time.monotonic() - started
    stop.set()
    result.health_seconds, result.health_failures = await asyncio.to_thread(out.get, True, 30)
    prober.join(5)
    return result


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="default: the server's first model")
    parser.add_argument("--num-requests", type=int, default=1000, help="sent at once")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--health-interval", type=float, default=0.2)
    parser.add_argument("--api-key")
    parser.add_argument("--output", help="write the summary as JSON here")


def run_cli(args: argparse.Namespace) -> int:
    async def go() -> BurstResult:
        root = args.base_url.removesuffix("/").removesuffix("/v1")
        model = args.model or await first_model(root, args.api_key)
        return await run_burst(args.base_url, args.num_requests, model, args.max_tokens,
                               args.health_interval, api_key=args.api_key)
    result = asyncio.run(go())
    summary = result.summary()
    for status, s in summary["by_status"].items():
        print(f"{status}: {s['count']:6d}  p50 {s['p50_s']:7.2f} s  max {s['max_s']:7.2f} s")
    print(f"all {summary['requests']} answered in {summary['elapsed_s']:.2f} s; /health: "
          f"{summary['health_polls']} polls, {summary['health_failures']} failed, worst "
          f"{summary['health_worst_s']:.3f} s")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"summary": summary, "answers": [asdict(a) for a in result.answers[:50]]},
                      f, indent=1)
    return 0
