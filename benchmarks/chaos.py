"""`bench chaos`: `bench soak`'s request mix through a running server while its engine cores are
killed (SIGKILL) or frozen (SIGSTOP: to their replica, a core that has stopped speaking) in turn,
one every `--period-s`; run it on the server's node.

What a client saw: each event's requests in flight and how long after it the last of them ended,
how long until a request succeeded again, every status and error, /health's answers (it must
answer throughout), the longest request. It fails (exit 1) where a request in flight outlived the
event by more than its bound (`--end-within-s`: a killed core's requests end at once, a frozen
one's once it has been silent for the replica's `core_silence_s`, 15 s by default), an answer was
a 5xx other than 503 or the client gave up on one, or no request succeeded within
`--recover-within-s` of an event. A replica whose core keeps failing is replaced by Serve (after
`MAX_RESTARTS` in `RESTART_WINDOW_S`, replicas/core_client.py): a run long enough sees that too."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.client import first_model
from benchmarks.soak import Outcome, attempt, request_body

CORE_MARKER = "shardserve::EngineCore"
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--period-s", type=float, default=25.0, help="between two events")
    p.add_argument("--actions", type=parse_actions, default="kill,kill,stop",
                   help="the events' signals in turn, each 'kill' or 'stop'")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--end-within-s", type=parse_bounds, default="kill=5,stop=25",
                   help="how long after an event each of its requests in flight may take to end")
    p.add_argument("--recover-within-s", type=float, default=90.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", type=Path)


@dataclass(frozen=True)
class Event:
    at: float  # seconds since the run's start
    action: str  # kill, stop, or none (no core was running)
    pid: int | None


def cores() -> list[psutil.Process]:
    """This node's engine cores that can be signalled (a frozen one until its replica kills it
    is passed over)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if (CORE_MARKER in " ".join(proc.info["cmdline"] or ())
                and proc.info["status"] not in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED)):
            found.append(proc)
    return sorted(found, key=lambda p: p.pid)


def parse_actions(text: str) -> list[str]:
    actions = [a.strip() for a in text.split(",")]
    if any(a not in SIGNALS for a in actions):
        raise argparse.ArgumentTypeError(f"each of {sorted(SIGNALS)}, got {text!r}")
    return actions


def parse_bounds(text: str) -> dict[str, float]:
    bounds = {}
    for part in text.split(","):
        action, _, seconds = part.partition("=")
        if action not in SIGNALS or not seconds:
            raise argparse.ArgumentTypeError(f"{part!r}: want ACTION=SECONDS, ACTION in "
                                             f"{sorted(SIGNALS)}")
        bounds[action] = float(seconds)
    return bounds


def summarize(outcomes: list[Outcome], events: list[Event], health: list[tuple[float, Any]],
              end_within: dict[str, float], recover_within: float,
              duration: float) -> dict[str, Any]:
    """The run's report, and its failures (each a line)."""
    failures: list[str] = []
    per_event = []
    for e in events:
        inflight = [o for o in outcomes if o.start < e.at < o.end]
        last_end = max((o.end - e.at for o in inflight), default=0.0)
        after = [o.end - e.at for o in outcomes if o.start >= e.at and o.ok]
        recovered = min(after, default=None)
        per_event.append({"at": e.at, "action": e.action, "pid": e.pid,
                          "in_flight": len(inflight),
                          "in_flight_failed": sum(not o.ok for o in inflight),
                          "last_end_s": last_end, "first_success_s": recovered})
        bound = end_within.get(e.action)
        if bound is not None and last_end > bound:
            failures.append(f"a request in flight at the {e.action} at {e.at:.0f} s ended "
                            f"{last_end:.1f} s after it (bound {bound:g} s)")
        if recovered is None and e.at + recover_within < duration:
            failures.append(f"no request succeeded after the {e.action} at {e.at:.0f} s")
        elif recovered is not None and recovered > recover_within:
            failures.append(f"the first success after the {e.action} at {e.at:.0f} s came "
                            f"{recovered:.0f} s after it")
    statuses = collections.Counter(str(o.status) for o in outcomes)
    errors = collections.Counter((o.status, (o.error or "")[:100]) for o in outcomes
                                 if o.error is not None)
    bad = [o for o in outcomes if o.status is not None and o.status >= 500 and o.status != 503]
    if bad:
        failures.append(f"{len(bad)} answers were a 5xx other than 503: {bad[0].error}")
    gave_up = [o for o in outcomes if o.exception is not None]
    if gave_up:
        failures.append(f"{len(gave_up)} requests raised in the client: {gave_up[0].exception}")
    unanswered = [t for t, status in health if not isinstance(status, int)]
    if unanswered:
        failures.append(f"/health did not answer {len(unanswered)} times (first at "
                        f"{unanswered[0]:.0f} s)")
    return {"requests": len(outcomes), "succeeded": sum(o.ok for o in outcomes),
            "statuses": dict(statuses),
            "errors": [{"status": s, "error": m, "count": n} for (s, m), n in errors.most_common()],
            "events": per_event,
            "health_not_200": sum(status != 200 for _, status in health),
            "health_checks": len(health),
            "longest_request_s": max((o.end - o.start for o in outcomes), default=0.0),
            "failures": failures}


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or await first_model(args.base_url, args.api_key)
    base = args.base_url.rstrip("/")
    url = base + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if not cores():
        raise RuntimeError(f"no {CORE_MARKER} process on this node: run on the server's node")
    rng = random.Random(args.seed)
    start = time.monotonic()

    def clock() -> float:
        return time.monotonic() - start

    outcomes: list[Outcome] = []
    events: list[Event] = []
    health: list[tuple[float, Any]] = []

    async def chaos() -> None:
        n = 0
        while clock() + args.period_s < args.duration_s:
            await asyncio.sleep(args.period_s)
            running = cores()
            if not running:
                events.append(Event(clock(), "none", None))
                continue
            action = args.actions[n % len(args.actions)]
            target = running[n % len(running)]
            try:
                target.send_signal(SIGNALS[action])
            except psutil.Error:
                continue
            events.append(Event(clock(), action, target.pid))
            print(f"{clock():7.1f} s  {action} engine core {target.pid}", flush=True)
            n += 1

    async def watch_health(client: httpx.AsyncClient) -> None:
        while clock() < args.duration_s:
            at = clock()
            try:
                health.append((at, (await client.get(base + "/health", timeout=5)).status_code))
            except httpx.HTTPError as exc:
                health.append((at, repr(exc)))
            await asyncio.sleep(1.0)

    async def worker(client: httpx.AsyncClient, first: int) -> None:
        i = first
        while clock() < args.duration_s:
            outcomes.append(await attempt(client, url, request_body(model, i, rng, args.max_tokens),
                                          stream=i % 2 == 0, disconnect=i % 10 == 4,
                                          clock=clock))
            i += args.max_concurrency

    limits = httpx.Limits(max_connections=args.max_concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits,
                                 headers=headers) as client:
        await asyncio.gather(chaos(), watch_health(client),
                             *(worker(client, w) for w in range(args.max_concurrency)))
    result = summarize(outcomes, events, health, args.end_within_s, args.recover_within_s,
                       args.duration_s)
    result["model"] = model
    result["outcomes"] = [asdict(o) for o in outcomes]
    return result


def run_cli(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(_run(args))
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{result['requests']} requests, {result['succeeded']} succeeded; statuses "
          f"{result['statuses']}; longest {result['longest_request_s']:.1f} s; /health not 200 "
          f"{result['health_not_200']} of {result['health_checks']}")
    for e in result["errors"][:8]:
        print(f"  {e['count']:6d} x {e['status']}: {e['error']}")
    print(f"{'at s':>7s} {'event':>6s} {'in flight':>9s} {'failed':>6s} {'last ended':>10s} "
          f"{'success after':>13s}")
    for e in result["events"]:
        success = "-" if e["first_success_s"] is None else f"{e['first_success_s']:.1f} s"
        print(f"{e['at']:7.1f} {e['action']:>6s} {e['in_flight']:9d} {e['in_flight_failed']:6d} "
              f"{e['last_end_s']:8.1f} s {success:>13s}")
    for line in result["failures"]:
        print(f"FAIL: {line}")
    if args.result_json:
        args.result_json.write_text(json.dumps(result, indent=2))
        print(f"results written to {args.result_json}")
    return 1 if result["failures"] else 0
