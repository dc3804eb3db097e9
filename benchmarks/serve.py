"""The ``bench serve`` runner: builds requests, sends them on an open-loop arrival schedule
(``--request-rate``/``--burstiness``) and/or a closed-loop cap (``--max-concurrency``), then
prints the result table and writes ``--result-json`` (config, summary, every request)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks import datasets
from benchmarks.arrivals import send_offsets
from benchmarks.client import ClientConfig, StreamingClient, first_model
from benchmarks.client_processes import auto_num_clients, run_shares, split
from benchmarks.datasets import BenchRequest
from benchmarks.metrics import DEFAULT_PERCENTILES, BenchmarkMetrics, compute_metrics, parse_goodput, parse_percentiles
from benchmarks.records import RequestOutcome
from benchmarks.report import format_errors, format_table

RESULT_SCHEMA_VERSION = 1

SendFn = Callable[[BenchRequest], Awaitable[RequestOutcome]]


class WarmupError(RuntimeError):
    """A warmup request failed: the server is not ready for (or rejects) this workload."""


@dataclass(frozen=True)
class RunSettings:
    """How requests are scheduled and summarised."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    seed: int = 0
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    goodput_slos: Mapping[str, float] = field(default_factory=dict)
    show_progress: bool = True


@dataclass(frozen=True)
class BenchmarkRun:
    """Outcomes in request order, ``start_time`` rebased to seconds since the run started."""

    outcomes: tuple[RequestOutcome, ...]
    metrics: BenchmarkMetrics
    duration_s: float


async def _bounded(send: SendFn, request: BenchRequest, limit: asyncio.Semaphore | None) -> RequestOutcome:
    if limit is None:
        return await send(request)
    async with limit:
        return await send(request)


async def warm_up(
    send: SendFn, requests: Sequence[BenchRequest], num_warmups: int, max_concurrency: int | None
) -> None:
    """Send ``num_warmups`` requests (cycling ``requests``), untimed; raise on the first failure."""
    if num_warmups <= 0 or not requests:
        return
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    batch = [requests[i % len(requests)] for i in range(num_warmups)]
    outcomes = await asyncio.gather(*(_bounded(send, r, limit) for r in batch))
    failed = [o for o in outcomes if not o.success]
    if failed:
        raise WarmupError(f"{len(failed)}/{len(outcomes)} warmup request(s) failed: {failed[0].error}")


async def run_benchmark(
    send: SendFn,
    requests: Sequence[BenchRequest],
    settings: RunSettings,
    warmup_requests: Sequence[BenchRequest] = (),
) -> BenchmarkRun:
    """Send every request on the arrival schedule, capped at ``max_concurrency`` in flight.

    Warmups cycle ``warmup_requests`` (or ``requests`` when none are given; distinct prompts are
    better, since a warmed-up prompt may hit the server's prefix cache when measured).
    A request waiting for a concurrency slot is not yet timed (its latency starts when ``send``
    starts), as in vllm. Duration runs from the first dispatch to the last completion.
    """
    _check(requests, settings)
    await warm_up(send, warmup_requests or requests, settings.num_warmups, settings.max_concurrency)

    progress = tqdm(total=len(requests), disable=not settings.show_progress, unit="req")
    start = time.perf_counter()
    try:
        outcomes = await dispatch(send, requests, settings, start, lambda: progress.update(1))
    finally:
        progress.close()
    return summarise(outcomes, start, time.perf_counter() - start, settings)


async def run_load(
    config: ClientConfig,
    requests: Sequence[BenchRequest],
    settings: RunSettings,
    warmup_requests: Sequence[BenchRequest] = (),
    num_clients: int = 1,
) -> BenchmarkRun:
    """``run_benchmark`` over HTTP, its load split over ``num_clients`` client processes (one:
    this process). Warmups go from this process first; duration runs from the first process's
    first dispatch to the last completion in any of them."""
    _check(requests, settings)
    shares = split(len(requests), settings.max_concurrency, settings.request_rate, settings.seed,
                   num_clients)
    async with StreamingClient(config) as client:
        if len(shares) == 1:
            return await run_benchmark(client.send, requests, settings, warmup_requests)
        await warm_up(client.send, warmup_requests or requests, settings.num_warmups,
                      settings.max_concurrency)
    outcomes, start, end = await run_shares(config, requests, settings, shares)
    return summarise(outcomes, start, end - start, settings)


def _check(requests: Sequence[BenchRequest], settings: RunSettings) -> None:
    if settings.max_concurrency is not None and settings.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {settings.max_concurrency}")
    if not requests:
        raise ValueError("no requests to send")


async def dispatch(send: SendFn, requests: Sequence[BenchRequest], settings: RunSettings,
                   start: float, on_done: Callable[[], None]) -> list[RequestOutcome]:
    """Send every request on the arrival schedule counted from ``start``, capped at
    ``max_concurrency`` in flight; ``on_done`` after each completion."""
    offsets = send_offsets(len(requests), settings.request_rate, settings.burstiness, settings.seed)
    limit = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None

    async def one(request: BenchRequest) -> RequestOutcome:
        outcome = await _bounded(send, request, limit)
        on_done()
        return outcome

    tasks: list[asyncio.Task[RequestOutcome]] = []
    try:
        for request, offset in zip(requests, offsets):
            # Sleep to an absolute target so scheduling jitter does not accumulate into the rate.
            delay = start + float(offset) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


def summarise(outcomes: Sequence[RequestOutcome], start: float, duration: float,
              settings: RunSettings) -> BenchmarkRun:
    """Outcomes rebased to ``start`` and their metrics over ``duration``."""
    rebased = tuple(replace(o, start_time=o.start_time - start) for o in outcomes)
    metrics = compute_metrics(rebased, duration, settings.percentiles, settings.goodput_slos)
    return BenchmarkRun(rebased, metrics, duration)


def result_document(run: BenchmarkRun, config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``--result-json`` content: enough to recompute any metric or plot later."""
    return {
        "schema_version": RESULT_SCHEMA_VERSION,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": dict(config),
        "summary": run.metrics.to_summary(),
        "requests": [o.to_dict() for o in run.outcomes],
    }


def write_result(path: str | Path, document: Mapping[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(document), indent=2, allow_nan=False) + "\n", encoding="utf-8")


def _jsonable(value: Any) -> Any:
    """JSON has no Infinity/NaN (an unbounded request rate is inf): write those as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


# ---------------------------------------------------------------------------------------------
# command line


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or 'inf'") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0 (or inf)")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError("must be a finite number > 0")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError("must be in [0, 1)")
    return value


def _as_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Adapt a ValueError-raising parser into an argparse ``type``."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} must be KEY=VALUE")
    return key, value


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Register ``bench serve`` flags (names follow ``vllm bench serve`` where one exists)."""
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    target.add_argument("--endpoint", default="/v1/chat/completions", help="path of the streaming endpoint")
    target.add_argument(
        "--api", choices=("chat", "completions"), default=None, help="request format (default: from --endpoint)"
    )
    target.add_argument("--model", default=None, help="model name (default: first of GET /v1/models)")
    target.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)"
    )
    target.add_argument("--timeout", type=_positive_float, default=600.0, help="per-request timeout, seconds")

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=datasets.DATASETS, default="random")
    data.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (sharegpt)")
    data.add_argument(
        "--tokenizer", default=None, help="local tokenizer path for exact token lengths (default: word-based estimate)"
    )
    data.add_argument("--num-prompts", type=_positive_int, default=1000)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--random-input-len", type=_non_negative_int, default=1024)
    data.add_argument("--random-output-len", type=_positive_int, default=128)
    data.add_argument("--random-range-ratio", type=_ratio, default=0.0, help="lengths uniform in [L*(1-r), L*(1+r)]")
    data.add_argument(
        "--random-prefix-len", type=_non_negative_int, default=0, help="tokens of prefix shared by all prompts"
    )
    data.add_argument(
        "--sharegpt-output-len", type=_positive_int, default=None, help="override the reply-derived output length"
    )
    data.add_argument(
        "--structured-mix",
        type=_as_type(datasets.parse_structured_mix),
        default=None,
        help="e.g. json_schema=2,regex=1,choice=1 (default: equal)",
    )
    data.add_argument(
        "--random-mm-image-size", type=_image_size, default=(336, 336), metavar="WxH",
        help="random-mm: each image's width x height")
    data.add_argument("--random-mm-images-per-request", type=_positive_int, default=1)
    data.add_argument(
        "--random-mm-distinct-images", type=_non_negative_int, default=0,
        help="random-mm: images drawn in turn from this many (0: every image new)")
    data.add_argument(
        "--structured-output-len", type=_positive_int, default=256, help="max_tokens cap for structured requests"
    )

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s, or inf to send all at once")
    load.add_argument(
        "--burstiness", type=_positive_float, default=1.0, help="gamma shape of arrivals: 1 = Poisson, <1 burstier"
    )
    load.add_argument(
        "--max-concurrency", type=_positive_int, default=None, help="cap on requests in flight (closed loop)"
    )
    load.add_argument("--num-warmups", type=_non_negative_int, default=0, help="untimed requests sent first")
    load.add_argument(
        "--num-clients",
        type=_positive_int,
        default=None,
        help="client processes sharing the load (default: one per 64 streams, at most half the cores)",
    )

    body = parser.add_argument_group("request body")
    body.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so outputs run to max_tokens")
    body.add_argument(
        "--continuous-usage-stats",
        action="store_true",
        help="ask for usage on every chunk (exact per-chunk token counts)",
    )
    body.add_argument("--temperature", type=float, default=None)
    body.add_argument("--extra-body", type=_json_object, default=None, help="JSON object merged into every request")

    out = parser.add_argument_group("output")
    out.add_argument(
        "--percentiles",
        type=_as_type(parse_percentiles),
        default=(90.0, 99.0),
        help="comma-separated, e.g. 50,90,99 (mean and median always shown)",
    )
    out.add_argument(
        "--goodput",
        nargs="+",
        type=_as_type(lambda item: parse_goodput([item])),
        default=None,
        metavar="NAME:MS",
        help="SLOs for goodput: ttft:MS tpot:MS e2el:MS",
    )
    out.add_argument("--result-json", default=None, help="write config, summary and per-request data here")
    out.add_argument("--label", default=None, help="name for this run in result files and plots")
    out.add_argument(
        "--metadata",
        nargs="*",
        type=_key_value,
        default=[],
        metavar="KEY=VALUE",
        help="extra config recorded in the result JSON",
    )
    out.add_argument("--disable-tqdm", action="store_true")


def _image_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, got {text!r}") from None
    if width < 1 or height < 1:
        raise argparse.ArgumentTypeError("image sides must be >= 1")
    return width, height


def load_requests(
    args: argparse.Namespace, num: int, seed: int, tokenizer: datasets.Tokenizer | None
) -> list[BenchRequest]:
    """Build ``num`` requests of the dataset the flags describe."""
    if args.dataset_name == "random":
        return datasets.random_requests(
            num,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            tokenizer,
            seed,
        )
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path")
        return datasets.sharegpt_requests(args.dataset_path, num, tokenizer, args.sharegpt_output_len, seed)
    if args.dataset_name == "structured":
        return datasets.structured_requests(num, args.structured_output_len, args.structured_mix, tokenizer, seed)
    if args.dataset_name == "random-mm":
        return datasets.random_mm_requests(
            num, args.random_input_len, args.random_output_len, args.random_mm_image_size,
            args.random_mm_images_per_request, args.random_mm_distinct_images, tokenizer, seed)
    raise ValueError(f"unknown dataset {args.dataset_name!r}")


def _config_record(args: argparse.Namespace, model: str, api: str, num_requests: int) -> dict[str, Any]:
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key", "metadata") and not callable(v)}
    config.update(model=model, api=api, num_requests=num_requests, metadata=dict(args.metadata or []))
    return config


async def _run(args: argparse.Namespace) -> int:
    tokenizer = datasets.load_tokenizer(args.tokenizer) if args.tokenizer else None
    requests = load_requests(args, args.num_prompts, args.seed, tokenizer)
    # Warmups come from another seed so the measured prompts are not already in a prefix cache.
    warmups = load_requests(args, args.num_warmups, args.seed + 1, tokenizer) if args.num_warmups else []
    if not requests:
        print("error: the dataset produced no requests", file=sys.stderr)
        return 1
    if len(requests) < args.num_prompts:
        print(f"warning: dataset yielded {len(requests)} of {args.num_prompts} requested prompts", file=sys.stderr)

    model = args.model or await first_model(args.base_url, args.api_key)
    extra_body = dict(args.extra_body or {})
    if args.temperature is not None:
        extra_body.setdefault("temperature", args.temperature)
    client_config = ClientConfig(
        base_url=args.base_url,
        model=model,
        endpoint=args.endpoint,
        api=args.api,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        continuous_usage_stats=args.continuous_usage_stats,
        extra_body=extra_body,
        timeout_s=args.timeout,
    )
    goodput = {name: ms for slo in args.goodput or [] for name, ms in slo.items()}
    settings = RunSettings(
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        seed=args.seed,
        percentiles=tuple(args.percentiles),
        goodput_slos=goodput,
        show_progress=not args.disable_tqdm,
    )
    num_clients = args.num_clients or auto_num_clients(args.max_concurrency, len(requests))
    print(
        f"Benchmarking {model} at {client_config.url}: {len(requests)} {args.dataset_name} requests, "
        f"rate={args.request_rate}, burstiness={args.burstiness}, max_concurrency={args.max_concurrency}"
        + (f", over {num_clients} client processes" if num_clients > 1 else "")
    )
    encoder_before = _encoder_counters(args.base_url) if args.dataset_name == "random-mm" else None
    run = await run_load(client_config, requests, settings, warmups, num_clients)

    print(format_table(run.metrics, args.max_concurrency, args.request_rate, goodput))
    if encoder_before:
        print(_encoder_line(encoder_before, _encoder_counters(args.base_url)))
    errors = format_errors(run.outcomes)
    if errors:
        print(errors)
    if args.result_json:
        write_result(
            args.result_json,
            result_document(run, {**_config_record(args, model, client_config.resolved_api, len(requests)),
                                  "num_clients": num_clients}),
        )
        print(f"Results written to {args.result_json}")
    return 0


_ENCODER_SERIES = ("shardserve:encoder_items_total", "shardserve:encoder_seconds_total",
                   "shardserve:encoder_cache_hits_total")


def _encoder_counters(base_url: str) -> dict[str, float] | None:
    """The server's encoder counters (shardserve's /metrics, summed over models); None for a
    server without them."""
    import httpx

    try:
        text = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    counters = dict.fromkeys(_ENCODER_SERIES, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in counters:
            counters[name] += float(line.rsplit(" ", 1)[1])
    return counters if any(name in text for name in _ENCODER_SERIES) else None


def _encoder_line(before: dict[str, float], after: dict[str, float] | None) -> str:
    """Encoder time per item over the run (warmups included; /metrics lags by a report)."""
    if after is None:
        return "Encoder (server): no counters"
    items, seconds, hits = (after[k] - before[k] for k in _ENCODER_SERIES)
    per_item = f"{1e3 * seconds / items:.1f} ms per item" if items else "-"
    return (f"Encoder (server): {items:.0f} items encoded, {per_item}, "
            f"{hits:.0f} encoder-cache hits")


def run_cli(args: argparse.Namespace) -> int:
    """Entry point for ``bench serve``; returns the process exit code."""
    try:
        return asyncio.run(_run(args))
    except (WarmupError, ValueError, OSError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
