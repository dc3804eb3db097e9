"""LLMReplica: the Ray Serve deployment that owns one Engine for one served model.

`generate` is a streaming method: the ingress calls it once per request through a DeploymentHandle
with `stream=True` and receives tuples of `TokenBatch`es, coalesced per choice. Under load a
request's tokens are grouped (`stream_messages_per_s`, `stream_interval`), so one Ray hop carries
several of them. A cancelled call (the client went away) aborts the request and frees its KV
blocks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from ray import serve
from tokenizers import Tokenizer
from transformers import AutoConfig

from replicas.engine import Engine, EngineConfig, compute_thread
from replicas import status_board
from replicas.executor import InProcessExecutor, RayExecutor
from replicas.logits_processors import load_factory
from replicas.model_files import resolve_model_path
from replicas.request import EngineError, GenerateRequest, TokenBatch
from replicas.worker import WorkerConfig
from structured.compiler import Compiled, Compiler
from structured.errors import ConstraintError
from structured.spec import Constraint
from structured.vocabulary import Vocabulary

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaConfig:
    model: str
    max_model_len: int | None = None
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    block_size: int = 16
    kv_cache_gib: float = 0.5
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024
    enable_prefix_caching: bool = True
    priority_scheduling: bool = False
    num_threads: int = 0  # 0: every core of the node
    shard_num_cpus: float = 0.5
    shard_num_gpus: float = 0.0
    logits_processors: tuple[str, ...] = ()  # the allowlist: qualified names
    structured_timeout_s: float = 10.0
    gil_switch_interval_s: float | None = 0.0005
    # tokens a choice buffers before its next message leaves the replica (vLLM's
    # --stream-interval): the first token and the last always go at once; more than 1 trades
    # smoothness for fewer messages through the replica -> ingress -> proxy -> client path
    stream_interval: int = 1
    # the replica's budget of streamed messages per second, shared by its running requests: each
    # waits at least num_running / budget seconds between messages (the first token and the last
    # go at once); with few streams or slow steps it changes nothing. 0: off. None: 500 where the
    # model runs on GPUs, where each message costs ~0.4 ms of the replica's GIL in Ray's
    # streaming path (on the H100, 256 streams of one token each held one core and starved the
    # engine loop); 50 on CPUs, where each message costs ~1 ms of CPU in the replica (Ray's
    # report of a generator item) and ~1.4 ms in the ingress, out of the cores the engine
    # computes on (2 cores, 32 streams, same run: 50 vs 150 gave 1.11x tok/s and 0.84 vs 0.76 of
    # the engine alone; a stream then gets a message about every num_running / 50 s)
    stream_messages_per_s: float | None = None
    # vLLM's --enforce-eager: no CUDA graphs for decode steps (they apply on CUDA at tp 1)
    enforce_eager: bool = False


def eos_token_ids(path: Path, hf_config) -> frozenset[int]:
    ids: set[int] = set()
    for source in (hf_config.to_dict(), _read_json(path / "generation_config.json")):
        eos = source.get("eos_token_id")
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
    return frozenset(ids)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def resolve_dtype(name: str, hf_config) -> str:
    if name != "auto":
        return name
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    dtype = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    if dtype == "float16" and not torch.cuda.is_available():
        return "bfloat16"  # fp16 matmuls are slow or missing on CPUs
    return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"


def _shard_name_prefix() -> str | None:
    """Names shard actors after their Serve replica, so operators (and tests) can find them."""
    try:
        ctx = serve.get_replica_context()
    except Exception:  # not inside a Serve replica
        return None
    return f"shard-{ctx.replica_id.unique_id}" if ctx is not None else None


def _tokenizer_size(path: Path) -> int | None:
    file = path / "tokenizer.json"
    if not file.exists():
        return None
    return Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)


def _coalesce(items: list[TokenBatch]) -> tuple[TokenBatch, ...]:
    merged: dict[int, TokenBatch] = {}
    for b in items:
        prev = merged.get(b.choice_index)
        if prev is None:
            merged[b.choice_index] = b
            continue
        lps = None if prev.logprobs is None else prev.logprobs + (b.logprobs or ())
        merged[b.choice_index] = TokenBatch(
            b.choice_index, prev.token_ids + b.token_ids, lps, b.finish_reason, b.stop_reason,
            prev.num_prompt_tokens, prev.num_cached_tokens,
            prev.prompt_logprobs if prev.prompt_logprobs is not None else b.prompt_logprobs,
            accepted_prediction_tokens=(prev.accepted_prediction_tokens
                                        + b.accepted_prediction_tokens),
            rejected_prediction_tokens=(prev.rejected_prediction_tokens
                                        + b.rejected_prediction_tokens))
    return tuple(merged.values())


class LLMServer:
    """The replica's logic, usable without Serve (tests, `bench engine`)."""

    def __init__(self, config: ReplicaConfig, replica_id: str | None = None) -> None:
        self.config = config
        # named on each request's first batch, so the ingress can address stop_choice here
        self.replica_id = replica_id
        if config.gil_switch_interval_s:
            # the forward runs in a thread that takes the GIL back between torch ops; with
            # Python's default 5 ms switch interval, every time the event loop thread holds it
            # the forward stalls for up to 5 ms
            sys.setswitchinterval(config.gil_switch_interval_s)
        path = resolve_model_path(config.model)
        hf_config = AutoConfig.from_pretrained(path)
        dtype = resolve_dtype(config.dtype, hf_config)
        max_len = config.max_model_len or int(getattr(hf_config, "max_position_embeddings", 2048))
        head_dim = (getattr(hf_config, "head_dim", None)
                    or hf_config.hidden_size // hf_config.num_attention_heads)
        bytes_per_token = (2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads
                           * head_dim * torch.finfo(getattr(torch, dtype)).bits // 8)
        num_blocks = int(config.kv_cache_gib * 2**30 // (bytes_per_token * config.block_size))
        # never less than one full-length sequence, never more than every slot full-length
        blocks_per_seq = -(-max_len // config.block_size)
        num_blocks = max(blocks_per_seq, min(num_blocks, blocks_per_seq * config.max_num_seqs))
        num_threads = config.num_threads or os.cpu_count() or 1
        worker_config = WorkerConfig(str(path), dtype, num_blocks, config.block_size,
                                     config.tensor_parallel_size, num_threads,
                                     max_num_seqs=config.max_num_seqs, max_model_len=max_len,
                                     cuda_graphs=not config.enforce_eager)
        compute = compute_thread()
        if config.tensor_parallel_size == 1:
            # built on the thread that will run it: one OpenMP team for all torch work
            executor = compute.submit(InProcessExecutor, worker_config).result()
        else:
            executor = RayExecutor(worker_config, config.shard_num_cpus, config.shard_num_gpus,
                                   name_prefix=_shard_name_prefix())
        eos = eos_token_ids(path, hf_config)
        tokenizer_file = path / "tokenizer.json"
        # built once per replica, compiled against lazily: replicas that never see a
        # constrained request never start compile workers
        self.vocabulary = (Vocabulary.from_tokenizer(tokenizer_file, sorted(eos),
                                                     int(hf_config.vocab_size))
                           if tokenizer_file.exists() and eos else None)
        self.compiler: Compiler | None = None
        on_gpu = (torch.cuda.is_available() if config.tensor_parallel_size == 1
                  else config.shard_num_gpus > 0)
        self.stream_budget = (config.stream_messages_per_s
                              if config.stream_messages_per_s is not None
                              else 500.0 if on_gpu else 50.0)
        self.model_path = path
        self.vocab_size = int(hf_config.vocab_size)
        self.max_model_len = max_len
        self.dtype = dtype
        self.engine = Engine(
            EngineConfig(max_len, num_blocks, config.block_size, config.max_num_seqs,
                         config.max_num_batched_tokens, config.max_waiting,
                         config.enable_prefix_caching, config.priority_scheduling,
                         sampleable_vocab=_tokenizer_size(path)),
            executor, eos,
            {name: load_factory(name) for name in config.logits_processors}, compute)

    async def _compile(self, constraint: Constraint, client: str | None) -> Compiled:
        if self.compiler is None:
            if self.vocabulary is None:
                raise EngineError("structured outputs need the model's tokenizer.json",
                                  param="response_format")
            self.compiler = Compiler(self.vocabulary, timeout_s=self.config.structured_timeout_s)
        try:
            return await self.compiler.compile(constraint, client)
        except ConstraintError as exc:
            raise EngineError(exc.message, param=exc.param) from None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[tuple[TokenBatch, ...]]:
        compiled = None
        if request.constraint is not None:
            compiled = await self._compile(request.constraint, request.client)
        outbox = self.engine.add(request, compiled)
        outbox.min_tokens = self.config.stream_interval
        budget = self.stream_budget
        remaining = request.n
        first = True
        try:
            while remaining:
                items = await outbox.take()
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                batches = _coalesce(items)  # type: ignore[arg-type]
                if first and batches and self.replica_id is not None:
                    batches = (replace(batches[0], replica=self.replica_id), *batches[1:])
                first = False
                remaining -= sum(b.finish_reason is not None for b in batches)
                if budget:
                    outbox.hold_until = time.monotonic() + self.engine.num_running / budget
                yield batches
        finally:
            if remaining:  # cancelled, or the consumer stopped early (a stop string)
                self.engine.abort(request.request_id)

    def info(self) -> dict:
        return {"model_path": str(self.model_path), "max_model_len": self.max_model_len,
                "vocab_size": self.vocab_size, "dtype": self.dtype,
                "shard_num_parameters": self.engine.executor.shard_sizes(),
                "config": asdict(self.config)}

    def stats(self) -> dict:
        e = self.engine
        return {"max_model_len": self.max_model_len, "vocab_size": self.vocab_size,
                "num_running": e.num_running, "num_waiting": e.num_waiting,
                "kv_cache_usage": e.blocks.usage, "num_used_blocks": e.blocks.num_used_blocks,
                "preemptions": e.scheduler.num_preemptions,
                **asdict(e.stats), **e.health()}


@serve.deployment(max_ongoing_requests=256, health_check_period_s=10, health_check_timeout_s=60)
class LLMReplica:
    def __init__(self, config: ReplicaConfig, model_name: str) -> None:
        ctx = serve.get_replica_context()
        replica = ctx.replica_id.unique_id
        self.server = LLMServer(config, replica)
        loop = asyncio.get_running_loop()
        # the engine's state, for /health and /metrics, on a path of its own (no request slot);
        # and the ingresses' stop_choice messages on the same board
        self._reporter = loop.create_task(status_board.publish_forever(
            ctx.app_name, model_name, replica, self.server.stats))
        self._stops = loop.create_task(status_board.take_stops_forever(
            ctx.app_name, replica, self.server.engine.stop_choice))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[tuple[TokenBatch, ...]]:
        async with contextlib.aclosing(self.server.generate(request)) as stream:
            async for batches in stream:
                yield batches

    async def info(self) -> dict:
        return self.server.info()

    async def stats(self) -> dict:
        return self.server.stats()

    def check_health(self) -> None:
        """Serve replaces the replica when this raises: the engine failed, its loop ended, a
        step is wedged, or a shard is gone."""
        engine = self.server.engine
        health = engine.health()
        if health["failed"] is not None:
            raise RuntimeError(f"engine failed: {health['failed']}")
        if health["stalled"]:
            raise RuntimeError(f"an engine step has run for {health['step_running_s']:.0f} s")
        engine.executor.check_health()
