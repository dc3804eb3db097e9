"""`shardserve batch`: runs an OpenAI batch input file through a live deployment over HTTP.

Owns the two batch file formats (input lines `{custom_id, method, url, body}`, output lines
`{id, custom_id, response: {status_code, request_id, body}, error}`), resuming from a partly
written output file, and dispatch with bounded concurrency. It speaks HTTP only (no Ray, no
torch), so it runs anywhere the server is reachable: a laptop with a port-forward, or the head
node as a Ray job (`ray job submit --working-dir . -- shardserve batch ...`).

Exit codes: 0 every request has an output line with a response (4xx/5xx included, as OpenAI's
batch output does); 1 some requests got no response at all (connection errors, timeouts after
retries): their lines carry `error`, and `--retry-failed` redoes them; 2 bad input or output file,
nothing sent."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

SUPPORTED_URLS = frozenset({"/v1/chat/completions", "/v1/completions"})
# Statuses worth another try: the server is momentarily full (429) or a proxy could not reach a
# replica (502/503/504, e.g. while replicas restart or autoscale). 500 is a real engine error.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
MAX_REPORTED_PROBLEMS = 10


class BatchFileError(Exception):
    """The input or output file cannot be used; nothing was sent."""


@dataclass(frozen=True)
class BatchRequest:
    line_no: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    custom_id: str
    line: str  # the serialized output line, without the newline
    status_code: int | None  # None: no response (see `error` in the line)

    @property
    def failed(self) -> bool:
        return self.status_code is None or self.status_code >= 400


@dataclass(frozen=True)
class ResumeState:
    done_ids: frozenset[str]
    torn_bytes: int  # bytes of a partial last line that were cut off
    dropped_failed: int  # lines removed by --retry-failed


@dataclass(frozen=True)
class Summary:
    total: int
    done: int  # written by this run
    skipped: int  # already in the output file
    failed: int  # of `done`: a 4xx/5xx response or no response
    errors: int  # of `failed`: no response at all
    elapsed_s: float


# ---- input -------------------------------------------------------------------------------------
def _check_line(line_no: int, obj: Any) -> BatchRequest | str:
    """The request, or why the line is not one."""
    if not isinstance(obj, dict):
        return "not a JSON object"
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "`custom_id` must be a non-empty string"
    if obj.get("method", "POST") != "POST":
        return f"`method` must be POST, got {obj.get('method')!r}"
    url = obj.get("url")
    if url not in SUPPORTED_URLS:
        return f"`url` must be one of {sorted(SUPPORTED_URLS)}, got {url!r}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "`body` must be a JSON object"
    if body.get("stream"):
        # a batch output line holds one response body; an SSE stream has no place in it
        return "`body.stream` is not supported in a batch"
    return BatchRequest(line_no, custom_id, url, body)


def read_input(path: Path) -> list[BatchRequest]:
    """Every request, validated up front (like OpenAI's batch API): a bad line or a duplicate
    custom_id fails the whole file before anything is sent."""
    requests: list[BatchRequest] = []
    problems: list[str] = []
    first_line: dict[str, int] = {}
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise BatchFileError(f"cannot read {path}: {exc.strerror}") from None
    with handle:
        try:
            for line_no, raw in enumerate(handle, 1):
                if not raw.strip():
                    continue
                try:
                    checked = _check_line(line_no, json.loads(raw))
                except json.JSONDecodeError as exc:
                    checked = f"not valid JSON ({exc.msg})"
                if isinstance(checked, str):
                    problems.append(f"{path}:{line_no}: {checked}")
                elif checked.custom_id in first_line:
                    problems.append(f"{path}:{line_no}: duplicate custom_id {checked.custom_id!r} "
                                    f"(first on line {first_line[checked.custom_id]})")
                else:
                    first_line[checked.custom_id] = line_no
                    requests.append(checked)
        except UnicodeDecodeError:
            raise BatchFileError(f"{path} is not UTF-8 text") from None
    if problems:
        more = len(problems) - MAX_REPORTED_PROBLEMS
        shown = problems[:MAX_REPORTED_PROBLEMS] + ([f"... and {more} more"] if more > 0 else [])
        raise BatchFileError("invalid batch input:\n  " + "\n  ".join(shown))
    if not requests:
        raise BatchFileError(f"{path} holds no requests")
    return requests


# ---- output ------------------------------------------------------------------------------------
def _output_id(raw: bytes) -> tuple[str, bool] | None:
    """(custom_id, failed) of a complete output line, None if it is not one."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("custom_id"), str):
        return None
    response = obj.get("response")
    status = response.get("status_code") if isinstance(response, dict) else None
    failed = obj.get("error") is not None or not isinstance(status, int)
    return obj["custom_id"], failed


def prepare_output(path: Path, retry_failed: bool = False) -> ResumeState:
    """Makes `path` safe to append to and returns the custom_ids it already holds.

    Lines are written whole (one write each), so only the last one can be torn, by a kill
    mid-write: it is cut off. Any other unreadable line means the file is not ours (or was
    edited), and appending to it would hide that, so it is an error. With `retry_failed`, lines
    that got no response are removed (the file is rewritten through a temporary file and
    os.replace, so a kill meanwhile leaves the old file whole)."""
    if not path.exists():
        return ResumeState(frozenset(), 0, 0)
    done: set[str] = set()
    keep_until = 0  # byte offset after the last good line
    bad: list[tuple[int, int]] = []  # (line number, offset) of unreadable complete lines
    failed_offsets: list[tuple[int, int]] = []  # (start, end) of lines with no response
    size = path.stat().st_size
    with path.open("rb") as f:
        offset = 0
        for line_no, raw in enumerate(f, 1):
            end = offset + len(raw)
            if raw.endswith(b"\n"):
                parsed = _output_id(raw)
                if parsed is None:
                    if raw.strip():
                        bad.append((line_no, offset))
                else:
                    done.add(parsed[0])
                    if parsed[1]:
                        failed_offsets.append((offset, end))
                    keep_until = end
            offset = end
    # an unreadable line right at the end is a torn write too (nothing good follows it)
    bad = [(n, off) for n, off in bad if off < keep_until]
    if bad:
        numbers = ", ".join(str(n) for n, _ in bad[:MAX_REPORTED_PROBLEMS])
        raise BatchFileError(f"{path}: line(s) {numbers} are not batch output lines; "
                             "refusing to append to it (use another --output)")
    torn = size - keep_until
    if torn:
        os.truncate(path, keep_until)
    dropped = 0
    if retry_failed and failed_offsets:
        data = path.read_bytes()
        kept, start = [], 0
        for lo, hi in failed_offsets:
            kept.append(data[start:lo])
            start = hi
            obj = json.loads(data[lo:hi])
            done.discard(obj["custom_id"])
        kept.append(data[start:])
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(kept))
        os.replace(tmp, path)
        dropped = len(failed_offsets)
    return ResumeState(frozenset(done), torn, dropped)


def _output_line(batch_id: str, custom_id: str, response: dict[str, Any] | None,
                 error: dict[str, str] | None) -> str:
    # json.dumps escapes newlines inside strings, so the record is exactly one line
    return json.dumps({"id": batch_id, "custom_id": custom_id, "response": response,
                       "error": error}, ensure_ascii=False, separators=(",", ":"))


def _append(fd: int, line: str) -> None:
    """One write per line (O_APPEND), so a kill leaves whole lines plus at most one torn tail."""
    data = (line + "\n").encode("utf-8")
    while data:
        data = data[os.write(fd, data):]


# ---- sending -----------------------------------------------------------------------------------
async def send_one(client: httpx.AsyncClient, req: BatchRequest, max_retries: int) -> Outcome:
    batch_id = f"batch_req_{uuid.uuid4().hex}"
    # the server folds x-request-id into its completion id, so a line can be found in its logs
    headers = {"x-request-id": batch_id}
    error = {"code": "connection_error", "message": "not sent"}
    for attempt in range(max_retries + 1):
        if attempt:
            await asyncio.sleep(min(30.0, 0.5 * 2 ** (attempt - 1)))
        try:
            r = await client.post(req.url, json=req.body, headers=headers)
        except httpx.TimeoutException as exc:
            error = {"code": "timeout", "message": f"{type(exc).__name__}: {exc}"}
            continue
        except httpx.TransportError as exc:
            error = {"code": "connection_error", "message": f"{type(exc).__name__}: {exc}"}
            continue
        if r.status_code in RETRY_STATUSES and attempt < max_retries:
            continue
        try:
            body: Any = r.json()
        except ValueError:
            body = r.text  # e.g. a proxy's HTML error page
        request_id = body.get("id") if isinstance(body, dict) and r.status_code < 400 else None
        response = {"status_code": r.status_code, "request_id": request_id or batch_id,
                    "body": body}
        return Outcome(req.custom_id, _output_line(batch_id, req.custom_id, response, None),
                       r.status_code)
    return Outcome(req.custom_id, _output_line(batch_id, req.custom_id, None, error), None)


def _api_root(base_url: str) -> str:
    # input urls carry /v1 already; accept a base URL given with it too
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


async def run_batch(requests: list[BatchRequest], output: Path, base_url: str, *,
                    concurrency: int = 16, api_key: str | None = None, timeout_s: float = 600.0,
                    max_retries: int = 3, retry_failed: bool = False,
                    show_progress: bool = True) -> Summary:
    started = time.monotonic()
    state = prepare_output(output, retry_failed)
    if state.torn_bytes:
        print(f"shardserve batch: cut a partial last line ({state.torn_bytes} bytes) off {output}",
              file=sys.stderr, flush=True)
    if state.dropped_failed:
        print(f"shardserve batch: retrying {state.dropped_failed} request(s) that got no response",
              file=sys.stderr, flush=True)
    pending = [r for r in requests if r.custom_id not in state.done_ids]
    skipped = len(requests) - len(pending)
    done = failed = errors = 0
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # workers pull from one iterator, so at most `concurrency` requests (and bodies) are in flight
    queue: Iterator[BatchRequest] = iter(pending)
    bar = tqdm(total=len(requests), initial=skipped, unit="req", disable=not show_progress,
               file=sys.stderr, mininterval=0.2 if sys.stderr.isatty() else 10.0)
    try:
        fd = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        bar.close()
        raise BatchFileError(f"cannot write {output}: {exc.strerror}") from None
    try:
        async with httpx.AsyncClient(
                base_url=_api_root(base_url), headers=headers,
                timeout=httpx.Timeout(timeout_s, connect=min(30.0, timeout_s)),
                limits=httpx.Limits(max_connections=concurrency,
                                    max_keepalive_connections=concurrency)) as client:

            async def worker() -> None:
                nonlocal done, failed, errors
                for req in queue:
                    outcome = await send_one(client, req, max_retries)
                    _append(fd, outcome.line)
                    done += 1
                    failed += outcome.failed
                    errors += outcome.status_code is None
                    bar.update(1)

            await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(pending))))))
    finally:
        os.close(fd)
        bar.close()
    return Summary(len(requests), done, skipped, failed, errors, time.monotonic() - started)


# ---- command line ------------------------------------------------------------------------------
def add_batch_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `batch` on a host CLI's `add_subparsers()` object; parsed args carry
    `func(args) -> int`, the exit code."""
    p = subparsers.add_parser(
        "batch", help="run an OpenAI batch input file (JSONL) through a live server",
        description="Sends every line of an OpenAI batch input file to a running server and "
                    "appends OpenAI batch output lines. Re-running with the same --output "
                    "resumes: custom_ids already there are skipped.")
    p.add_argument("--input", type=Path, required=True, help="batch input JSONL")
    p.add_argument("--output", type=Path, required=True,
                   help="batch output JSONL (appended to; resumed from)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--api-key",
                   default=os.environ.get("SHARDSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $SHARDSERVE_API_KEY, then $OPENAI_API_KEY)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--max-retries", type=int, default=3,
                   help="retries on connection errors, timeouts, 429 and 502-504")
    p.add_argument("--retry-failed", action="store_true",
                   help="also redo requests the output file records as getting no response")
    p.add_argument("--stats-json", type=Path, help="write the summary here as JSON")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    if args.concurrency < 1 or args.max_retries < 0 or args.timeout <= 0:
        print("shardserve batch: --concurrency must be >= 1, --max-retries >= 0, --timeout > 0",
              file=sys.stderr)
        return 2
    if args.output.resolve() == args.input.resolve():
        print("shardserve batch: --output must not be the input file", file=sys.stderr)
        return 2
    # `shardserve` logs at INFO; httpx would log a line per request
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        requests = read_input(args.input)
        summary = asyncio.run(run_batch(
            requests, args.output, args.base_url, concurrency=args.concurrency,
            api_key=args.api_key, timeout_s=args.timeout, max_retries=args.max_retries,
            retry_failed=args.retry_failed, show_progress=not args.disable_tqdm))
    except BatchFileError as exc:
        print(f"shardserve batch: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"shardserve batch: interrupted; the same command resumes from {args.output}",
              file=sys.stderr)
        return 130
    print(f"shardserve batch: {summary.total} requests: {summary.done} done "
          f"({summary.failed} failed, {summary.errors} without a response), {summary.skipped} "
          f"skipped (already in {args.output}); {summary.elapsed_s:.1f} s", flush=True)
    if args.stats_json:
        args.stats_json.write_text(json.dumps(asdict(summary), indent=2) + "\n")
    return 1 if summary.errors else 0
