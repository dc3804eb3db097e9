"""EngineCore: everything of a model replica that computes, in a process of its own.

It owns the step loop, the scheduler, the KV cache, the sampler, the constraint guides (and their
compiler) and the model (at tp > 1, rank 0 and the shard actors of the other ranks). The
replica's Serve process is a thin front (replicas/core_client.py): it sends requests, aborts and
stop_choice messages, and fans the core's step messages out to the waiting `generate` calls. So
the engine's per-step Python never shares an interpreter (a GIL) with Ray Serve's per-request and
per-message work, and a core that dies or wedges can be killed and started again without taking
the replica down.

`python -m replicas.engine_core --spec FILE` runs one; its command line reads
`shardserve::EngineCore <model>` in `ps`, as vLLM's `VLLM::EngineCore`. With
`SHARDSERVE_CORE_PROFILE=DIR` in its environment (the server's, which Ray's workers inherit) it
runs under cProfile and writes `DIR/core-<pid>.prof` (pstats) when it stops: where a served
core's step time goes, on machines without py-spy or ptrace."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import ctypes
import json
import logging
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import AutoConfig

from replicas import core_protocol as proto
from replicas import kernels, kv_budget
from replicas.engine import Engine, EngineConfig, compute_thread
from replicas.executor import InProcessExecutor
from replicas.gguf_checkpoint import LINK
from replicas.heap import freeze_startup_heap
from replicas.ingress_routes import IngressRoutes
from replicas.kernels import isa
from replicas.logits_processors import load_factory
from replicas.model_files import resolve_model_path
from replicas.models import text_config
from replicas.niceness import set_niceness
from replicas.output_pacer import Errors, OutputPacer, Outputs
from replicas.replica_config import CoreSpec
from replicas.request import EngineError, GenerateRequest
from replicas.worker import WorkerConfig
from structured.compiler import Compiler
from structured.errors import ConstraintError
from structured.vocabulary import Vocabulary

logger = logging.getLogger(__name__)

# decode-only steps new requests may wait where steps replay CUDA graphs: at ~4 ms a step on an
# H200 (bench-135m, 256 rows), at most ~20 ms more TTFT. With mixed steps replayed too it still
# paid there: 256 streams served 20,085 tok/s (TPOT p50 10.1 ms) against 17,180 (11.7) with
# arrivals joining at once, in fewer, fuller steps (570 against 612; benchmarks/RESULTS.md)
DEFAULT_WAITING_STEPS = 4


def eos_token_ids(path: Path, hf_config: Any) -> frozenset[int]:
    ids: set[int] = set()
    # a multimodal config keeps the decoder's eos in its text config
    for source in (hf_config.to_dict(), text_config(hf_config).to_dict(),
                   _read_json(path / "generation_config.json")):
        eos = source.get("eos_token_id")
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
    return frozenset(ids)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def resolve_dtype(name: str, hf_config: Any, on_gpu: bool | None = None,
                  quantized: bool = False) -> str:
    """The compute dtype: `name` unless "auto"; then the checkpoint's on a GPU, and on a CPU what
    it computes fast (isa.compute_dtype: bf16 only with bf16 dot products; float32 elsewhere,
    where a bf16 checkpoint's linear weights stay bf16 in memory, see parallel.pack_weights).
    A GGUF checkpoint (`quantized`) computes in float32 on CPUs, where its block-quantized
    weights stay quantized (quant_linear.c), and in bf16 on GPUs, dequantized at load."""
    if name != "auto":
        return name
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    if quantized:
        return "bfloat16" if on_gpu else "float32"
    dtype = _checkpoint_dtype(hf_config)
    if dtype not in ("float32", "bfloat16", "float16"):
        return "float32"
    if on_gpu:
        return dtype
    if dtype == "float32":
        return dtype
    return str(isa.compute_dtype()).removeprefix("torch.")


def _checkpoint_dtype(hf_config: Any) -> str:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else "float32"


def resolve_kv_cache_dtype(name: str, dtype: str, hf_config: Any, on_gpu: bool,
                           quantized: bool = False, dtype_auto: bool = True) -> str:
    """The KV cache's dtype beside compute in `dtype`: `name` unless "auto"; then, where
    `--dtype auto` (`dtype_auto`) chose float32 on a CPU for a bf16 or float16 checkpoint or a
    block-quantized one, bf16 (the cache kept at the checkpoint's precision, as its weights are:
    half the bytes each decode step's attention reads, and twice the tokens in the same memory;
    llama.cpp's cache is 16-bit too); else `dtype`, as vLLM's "auto". A cache holds the compute
    dtype or, on CPUs, bf16 under float32 compute; anything else is a ValueError."""
    if name == "auto":
        narrow = quantized or _checkpoint_dtype(hf_config) in ("bfloat16", "float16")
        if (dtype_auto and not on_gpu and dtype == "float32" and narrow
                and kernels.supports_cache(torch.float32, torch.bfloat16, torch.device("cpu"))):
            return "bfloat16"
        return dtype
    if name == dtype:
        return name
    if on_gpu or (dtype, name) != ("float32", "bfloat16"):
        raise ValueError(f"--kv-cache-dtype {name} beside compute in {dtype}: the cache holds the "
                         "compute dtype, or bfloat16 under float32 compute on CPUs")
    if not kernels.supports_cache(torch.float32, torch.bfloat16, torch.device("cpu")):
        logger.warning("--kv-cache-dtype bfloat16 without the native CPU kernels: the torch path "
                       "widens every cached key and value it reads")
    return name


def resolve_dtypes(dtype: str, kv_cache_dtype: str, path: Path, hf_config: Any, on_gpu: bool,
                   quantize: bool = False) -> tuple[str, str]:
    """The compute and KV-cache dtypes of the checkpoint at `path` for `--dtype` and
    `--kv-cache-dtype` (either may be "auto"); `quantize`: the weights are quantized at load."""
    quantized = (path / LINK).exists() or quantize
    compute = resolve_dtype(dtype, hf_config, on_gpu, quantized)
    return compute, resolve_kv_cache_dtype(kv_cache_dtype, compute, hf_config, on_gpu, quantized,
                                           dtype_auto=dtype == "auto")


def _tokenizer_size(path: Path) -> int | None:
    file = path / "tokenizer.json"
    if not file.exists():
        return None
    return Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)


class EngineCore:
    """The engine and what feeds it: builds the model from a ReplicaConfig, compiles constraints,
    and turns commands into engine calls. `engine.on_outputs` is where its steps' outputs go."""

    def __init__(self, spec: CoreSpec) -> None:
        config = spec.config
        self.config = config
        if config.gil_switch_interval_s:
            sys.setswitchinterval(config.gil_switch_interval_s)
        path = resolve_model_path(config.model)
        hf_config = AutoConfig.from_pretrained(path)
        on_gpu = (torch.cuda.is_available() if config.tensor_parallel_size == 1
                  else config.shard_num_gpus > 0)
        dtype, kv_dtype = resolve_dtypes(config.dtype, config.kv_cache_dtype, path, hf_config,
                                         on_gpu, config.quantization is not None)
        logger.info("%s computes in %s over a %s KV cache (--dtype %s, --kv-cache-dtype %s; CPU "
                    "kernels: %s)", config.model, dtype, kv_dtype, config.dtype,
                    config.kv_cache_dtype, "-" if on_gpu else isa.selected())
        decoder = text_config(hf_config)  # the KV cache's and the vocabulary's dimensions
        max_len = config.max_model_len or int(getattr(decoder, "max_position_embeddings", 2048))
        head_dim = (getattr(decoder, "head_dim", None)
                    or decoder.hidden_size // decoder.num_attention_heads)
        bytes_per_token = kv_budget.kv_bytes_per_token(
            decoder.num_hidden_layers, decoder.num_key_value_heads, head_dim,
            torch.finfo(getattr(torch, kv_dtype)).bits // 8)
        shape = kv_budget.BlockShape(bytes_per_token * config.block_size,
                                     -(-max_len // config.block_size), config.max_num_seqs)
        kv_gib = kv_budget.cache_gib(config.kv_cache_gib, on_gpu)
        # 0: each shard sizes its cache from its GPU's memory once its weights are loaded
        num_blocks = 0 if kv_gib is None else kv_budget.blocks_for_gib(kv_gib, shape)
        num_threads = config.num_threads or os.cpu_count() or 1
        worker_config = WorkerConfig(str(path), dtype, num_blocks, config.block_size,
                                     config.tensor_parallel_size, num_threads,
                                     max_num_seqs=config.max_num_seqs, max_model_len=max_len,
                                     cuda_graphs=not config.enforce_eager,
                                     quantization=config.quantization,
                                     gpu_memory_utilization=config.gpu_memory_utilization,
                                     max_num_batched_tokens=config.max_num_batched_tokens,
                                     kv_cache_dtype=kv_dtype)
        compute = compute_thread()
        # built on the thread that will run it: one OpenMP team for all torch work (at tp > 1,
        # rank 0's)
        if config.tensor_parallel_size == 1:
            executor = compute.submit(InProcessExecutor, worker_config).result()
        else:
            from replicas.ray_executor import RayExecutor  # Ray's ~36 MB only where it is used
            executor = compute.submit(RayExecutor, worker_config, config.shard_num_cpus,
                                      config.shard_num_gpus, name_prefix=spec.shard_name_prefix,
                                      placement_group_id=spec.placement_group_id).result()
        eos = eos_token_ids(path, hf_config)
        tokenizer_file = path / "tokenizer.json"
        # built once, compiled against lazily: cores that never see a constrained request never
        # start compile workers
        self.vocabulary = (Vocabulary.from_tokenizer(tokenizer_file, sorted(eos),
                                                     int(decoder.vocab_size))
                           if tokenizer_file.exists() and eos else None)
        self.compiler: Compiler | None = None
        self.info = {"model_path": str(path), "max_model_len": max_len,
                     "vocab_size": int(decoder.vocab_size), "dtype": dtype,
                     "kv_cache_dtype": kv_dtype, "isa": None if on_gpu else isa.selected(),
                     "on_gpu": on_gpu,
                     "shard_num_parameters": executor.shard_sizes(),
                     "weights": executor.weight_formats(), "pid": os.getpid(),
                     "cuda_graphs": executor.cuda_graphs(),
                     "kv_cache_tokens": executor.num_blocks() * config.block_size,
                     "stream_pace": config.stream_pace(on_gpu)}
        # what the 4-bit linears multiply (kernels.quant_activations), where there are any
        self.info["quant_activations"] = (
            kernels.quant_activations() if any(k.startswith("Q4") and k.endswith(" linear_q")
                                               for k in self.info["weights"]) else None)
        if self.info["quant_activations"]:
            logger.info("4-bit linears multiply %s activations (%s)",
                        self.info["quant_activations"], kernels.QUANT_ACTIVATIONS_ENV)
        waiting_steps = config.max_waiting_steps
        if waiting_steps is None:
            waiting_steps = DEFAULT_WAITING_STEPS if self.info["cuda_graphs"] else 0
        self.info["max_waiting_steps"] = waiting_steps
        self.info["async_scheduling"] = config.async_scheduling
        self.engine = Engine(
            EngineConfig(max_len, executor.num_blocks(), config.block_size, config.max_num_seqs,
                         config.max_num_batched_tokens, config.max_waiting,
                         config.enable_prefix_caching, config.priority_scheduling,
                         waiting_steps, sampleable_vocab=_tokenizer_size(path),
                         step_stall_s=config.step_timeout_s,
                         async_scheduling=self.info["async_scheduling"]),
            executor, eos,
            {name: load_factory(name) for name in config.logits_processors}, compute)
        # requests whose constraint is compiling: an abort meanwhile cancels the compile
        self._compiling: dict[str, asyncio.Task] = {}
        self.pacer: OutputPacer | None = None

    def connect(self, send: Callable[[Outputs, Errors], None]) -> None:
        """Where the engine's outputs go: to `send`, gathered under the stream floor."""
        self.pacer = OutputPacer(send, self.info["stream_pace"][1])
        self.engine.on_outputs = self.pacer.put

    # ---- commands ------------------------------------------------------------------------------
    def handle(self, commands: list[tuple]) -> None:
        for command in commands:
            kind = command[0]
            if kind == proto.ADD:
                self.add(command[1])
            elif kind == proto.ABORT:
                self.abort(command[1])
            elif kind == proto.STOP:
                self.engine.stop_choice(*command[1:])

    def add(self, request: GenerateRequest) -> None:
        if request.constraint is None:
            self._add(request, None)
            return
        task = asyncio.get_running_loop().create_task(self._compile_then_add(request))
        self._compiling[request.request_id] = task
        task.add_done_callback(lambda _: self._compiling.pop(request.request_id, None))

    def abort(self, request_id: str) -> None:
        task = self._compiling.pop(request_id, None)
        if task is not None:
            task.cancel()
        if self.pacer is not None:
            self.pacer.forget(request_id)
        self.engine.abort(request_id)

    def _add(self, request: GenerateRequest, compiled: Any) -> None:
        try:
            self.engine.add(request, compiled)
        except EngineError as exc:
            self.engine.on_outputs([], [(request.request_id, exc)])

    async def _compile_then_add(self, request: GenerateRequest) -> None:
        try:
            compiled = await self._compile(request)
        except EngineError as exc:
            self.engine.on_outputs([], [(request.request_id, exc)])
            return
        self._add(request, compiled)

    async def _compile(self, request: GenerateRequest) -> Any:
        if self.compiler is None:
            if self.vocabulary is None:
                raise EngineError("structured outputs need the model's tokenizer.json",
                                  param="response_format")
            self.compiler = Compiler(self.vocabulary, timeout_s=self.config.structured_timeout_s)
        try:
            return await self.compiler.compile(request.constraint, request.client)
        except ConstraintError as exc:
            raise EngineError(exc.message, param=exc.param) from None

    def stats(self) -> dict[str, Any]:
        e = self.engine
        return {"max_model_len": self.info["max_model_len"],
                "vocab_size": self.info["vocab_size"], "dtype": self.info["dtype"],
                "kv_cache_dtype": self.info["kv_cache_dtype"],
                "isa": self.info["isa"], "weights": self.info["weights"],
                "quant_activations": self.info["quant_activations"],
                "num_running": e.num_running, "num_waiting": e.num_waiting,
                "kv_cache_usage": e.blocks.usage, "num_used_blocks": e.blocks.num_used_blocks,
                "num_blocks": e.blocks.num_blocks,
                "preemptions": e.scheduler.num_preemptions,
                "held_steps": e.scheduler.num_held_steps,
                **asdict(e.stats), **e.health()}

    def shutdown(self) -> None:
        for task in list(self._compiling.values()):
            task.cancel()
        if self.compiler is not None:
            self.compiler.close()
        self.engine.executor.shutdown()


# ---- the process ---------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """The kernel kills this process when the replica's process dies, however it dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _set_title(name: str) -> None:
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(f"shardserve::EngineCore {name}")


async def _serve(spec: CoreSpec, input_addr: str, output_addr: str, parent: int) -> None:
    import zmq

    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 1000)
    out.setsockopt(zmq.SNDHWM, 0)
    out.connect(output_addr)
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.RCVHWM, 0)
    inp.connect(input_addr)
    loop = asyncio.get_running_loop()

    # only shard actors need Ray: a core at tp = 1 does not join the cluster (a driver's
    # threads and connections for nothing)
    if spec.ray_address is not None and spec.config.tensor_parallel_size > 1:
        import ray
        ray.init(address=spec.ray_address, namespace=spec.ray_namespace,
                 runtime_env=spec.runtime_env, log_to_driver=False)
    core = EngineCore(spec)
    routes = IngressRoutes(ctx)

    def send(outputs: Outputs, errors: Errors) -> None:
        relayed, ended = routes.split(outputs, errors)
        if relayed or errors or ended:
            out.send(proto.encode_step(relayed, errors, ended))

    # one message per step, or per stream floor: the engine hands a step's outputs over once,
    # at its end
    core.connect(send)
    done = loop.create_future()

    def on_commands(commands: list[tuple]) -> None:
        for command in commands:
            routes.handle(command)
            if command[0] == proto.STATS:
                out.send(proto.encode([proto.STATS, command[1], core.stats()]))
            elif command[0] == proto.SHUTDOWN and not done.done():
                done.set_result(None)
        core.handle(commands)

    def read() -> None:  # a thread: blocks in zmq, not on the event loop
        while not done.done():
            try:
                if inp.poll(200):
                    commands = proto.decode_commands(inp.recv())
                    loop.call_soon_threadsafe(on_commands, commands)
            except zmq.ZMQError:
                return

    threading.Thread(target=read, name="core-input", daemon=True).start()
    freeze_startup_heap()
    out.send(proto.encode([proto.READY, core.info]))

    async def beat() -> None:
        while True:
            if os.getppid() != parent:  # the replica is gone (a fallback to PDEATHSIG)
                os._exit(0)
            # (a loop that ended by an error has failed its requests and says so in `failed`:
            # the front then starts a new core)
            out.send(proto.encode([proto.BEAT, core.stats()]))
            await asyncio.sleep(proto.HEARTBEAT_S)

    beater = loop.create_task(beat())
    try:
        await done
    finally:
        beater.cancel()
        core.shutdown()
        routes.close()
        out.close(linger=1000)
        inp.close(linger=0)
        ctx.term()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="shardserve::EngineCore")
    parser.add_argument("--spec", required=True, help="a pickled CoreSpec (deleted once read)")
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    _die_with_parent()
    if os.getppid() != args.parent:
        sys.exit(0)
    with open(args.spec, "rb") as f:
        spec: CoreSpec = pickle.load(f)  # noqa: S301  (written by our replica, 0600)
    os.unlink(args.spec)
    _set_title(spec.name)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s EngineCore %(levelname)s "
                        "%(name)s: %(message)s")
    set_niceness(spec.config.core_niceness, "engine core")
    profile = _profiler(os.environ.get("SHARDSERVE_CORE_PROFILE"))

    def _exit(*_: Any) -> None:
        profile()
        os._exit(0)
    signal.signal(signal.SIGTERM, _exit)
    try:
        asyncio.run(_serve(spec, args.input, args.output, args.parent))
    finally:
        profile()


def _profiler(folder: str | None) -> Any:
    """Starts cProfile when `folder` is set; returns what writes its stats there (once)."""
    if not folder:
        return lambda: None
    prof = cProfile.Profile()
    prof.enable()
    path = Path(folder) / f"core-{os.getpid()}.prof"

    def dump() -> None:
        if not path.exists():
            prof.disable()
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.dump_stats(path)
            logger.info("core profile written to %s", path)
    return dump


if __name__ == "__main__":
    main()
