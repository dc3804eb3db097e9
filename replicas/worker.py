"""ShardWorker: one tensor-parallel rank: its slice of the weights, its slice of the KV cache, and
the model runner. Rank 0 runs in the engine core's process; at tp>1 every other rank is a Ray actor
(one per GPU/bundle)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig

from replicas import host_memory, kernels, kv_budget
from replicas.cuda_graphs import StepGraphs
from replicas.loader import load_weights, quantize_int8
from replicas.model_runner import ModelRunner, StepInput, StepOutput
from replicas.models import get_model_class, text_config
from replicas.models.parallel import LINEARS, VocabParallelEmbedding, pack_weights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    model_path: str
    dtype: str  # "float32" | "bfloat16" | "float16"
    num_blocks: int  # 0: on a GPU, what fits in gpu_memory_utilization (replicas/kv_budget.py)
    block_size: int
    tp_size: int = 1
    num_threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    # CUDA graphs (CUDA, tp 1) need the largest batch, step and context to size their buffers;
    # 0 leaves them off, as does cuda_graphs=False (vLLM's --enforce-eager)
    max_num_seqs: int = 0
    max_model_len: int = 0
    cuda_graphs: bool = True
    # the sampled rows' logits stay on the device for the sampler: only when the engine is in
    # the same process (a shard actor's answer crosses Ray and must be on the host)
    logits_on_device: bool = False
    # "int8": every linear's float weight quantized to Q8_0 blocks after loading (CPUs, tp 1,
    # float32 compute: where linear_q runs)
    quantization: str | None = None
    gpu_memory_utilization: float = 0.9
    # the largest prefill chunk: the activations the GPU's KV budget leaves room for
    max_num_batched_tokens: int = 2048
    # the KV cache's element type; None: the compute dtype's (engine_core.resolve_kv_cache_dtype)
    kv_cache_dtype: str | None = None


def weight_formats(model: torch.nn.Module) -> dict[str, int]:
    """How many linears (and embeddings) hold each weight format, and the kernel that multiplies
    it: e.g. {"Q8_0 embedding": 1, "Q4_1 linear_q": 120, "Q8_0 linear_q": 1}."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if not isinstance(module, (*LINEARS, VocabParallelEmbedding)):
            continue
        w, fmt = module.weight, getattr(module, "quant_format", None)
        if not isinstance(module, LINEARS):
            kind = f"{fmt.name if fmt else str(w.dtype).removeprefix('torch.')} embedding"
        elif w.dtype == torch.uint8:  # the loader sets quant_format with a packed weight
            kind = f"{fmt.name} linear_q"
        elif w.dim() == 4:
            kind = "bfloat16 linear_bf16"
        elif w.dim() == 3:
            kind = "bfloat16 linear_mixed"
        else:
            kind = f"{str(w.dtype).removeprefix('torch.')} torch"
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class ShardWorker:
    def __init__(self, config: WorkerConfig, rank: int = 0, dist_init: str | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.rank = rank
        self.config = config
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if config.tp_size > 1:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            # a bounded timeout: a rank whose peer died must fail, not wait for 30 minutes
            dist.init_process_group(backend, init_method=dist_init, rank=rank,
                                    world_size=config.tp_size, timeout=timedelta(seconds=60))
        hf_config = AutoConfig.from_pretrained(config.model_path)
        dtype = torch_dtype(config.dtype)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = get_model_class(hf_config)(hf_config)
        finally:
            torch.set_default_dtype(previous)
        if self.device.type == "cuda":
            # cuDNN's SDPA builds an execution plan per new shape (each prefill row's length):
            # ~45 ms a call on an H100, prefill steps of ~0.6 s; flash / memory-efficient need none
            torch.backends.cuda.enable_cudnn_sdp(False)
        # block-quantized GGUF weights stay quantized where linear_q multiplies them
        # (kernels.supports: a CPU with the native kernels)
        keep_quantized = (config.tp_size == 1 and dtype == torch.float32
                          and kernels.supports(dtype, self.device))
        load_weights(model, Path(config.model_path), dtype, keep_quantized)
        if config.quantization == "int8":
            if not keep_quantized:
                raise ValueError("--quantization int8 runs on CPUs with the native kernels, at "
                                 "tensor-parallel size 1, computing in float32 (--dtype auto "
                                 "or float32)")
            quantize_int8(model)
        elif config.quantization is not None:
            raise ValueError(f"--quantization {config.quantization!r}: only int8 is supported")
        model.to(self.device).eval()
        pack_weights(model)
        # a decode step streams every weight: from huge pages 1.06-1.19x faster (host_memory)
        on_huge_pages = self.device.type == "cpu" and host_memory.weights_to_huge_pages(model)
        host_memory.release_free_heap()
        logger.info("weights: %s%s", ", ".join(f"{n} x {kind}"
                                               for kind, n in weight_formats(model).items()),
                    ", in one huge-page mapping" if on_huge_pages else "")
        # the decoder's layers (a multimodal model exposes its decoder's as `layers`)
        head_dim = model.layers[0].self_attn.head_dim
        kv_heads = model.layers[0].self_attn.num_kv_heads
        # no graphs for M-RoPE models: the graphs capture 1-D positions ([batch]), their rope
        # takes [3, batch] (and a decode token's three positions are start + delta, not start)
        graphs = (config.cuda_graphs and self.device.type == "cuda" and config.tp_size == 1
                  and config.max_num_seqs > 0 and config.max_model_len > 0
                  and not getattr(model, "uses_mrope", False))
        kv_dtype = torch_dtype(config.kv_cache_dtype or config.dtype)
        self.num_blocks = config.num_blocks or self._blocks_from_memory(
            text_config(hf_config), kv_heads, head_dim, kv_dtype, dtype)
        # with graphs, one block past the block manager's takes the padding rows' writes
        blocks = self.num_blocks + (1 if graphs else 0)
        shape = (text_config(hf_config).num_hidden_layers, 2, kv_heads,
                 blocks * config.block_size, head_dim)
        if self.device.type == "cpu":
            kv_cache = host_memory.zeros(shape, kv_dtype)
        else:
            kv_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)
        step_graphs = None
        if graphs:
            step_graphs = StepGraphs(
                model, kv_cache, config.block_size, config.max_num_seqs,
                config.max_num_batched_tokens, -(-config.max_model_len // config.block_size),
                pad_block=self.num_blocks)
            seconds = step_graphs.capture_all()
            logger.info("captured %d CUDA graphs (steps of up to %d tokens) in %.1f s",
                        len(step_graphs.graphs), step_graphs.max_tokens, seconds)
        self.runner = ModelRunner(model, kv_cache, config.block_size, step_graphs,
                                  logits_on_device=config.logits_on_device, dtype=dtype)

    def _blocks_from_memory(self, decoder: Any, kv_heads: int, head_dim: int,
                            kv_dtype: torch.dtype, dtype: torch.dtype) -> int:
        """The KV blocks that fit on this GPU beside the loaded weights (kv_budget)."""
        config = self.config
        if self.device.type != "cuda":
            raise ValueError("a CPU shard's KV cache is sized in GiB (num_blocks > 0)")
        width = torch.finfo(dtype).bits // 8
        shape = kv_budget.BlockShape(
            kv_budget.kv_bytes_per_token(decoder.num_hidden_layers, kv_heads, head_dim,
                                         torch.finfo(kv_dtype).bits // 8) * config.block_size,
            -(-config.max_model_len // config.block_size), config.max_num_seqs)
        heads = decoder.num_attention_heads // config.tp_size
        reserve = kv_budget.activation_reserve(
            config.max_num_batched_tokens, decoder.hidden_size,
            int(getattr(decoder, "intermediate_size", 4 * decoder.hidden_size)) // config.tp_size,
            (heads + 2 * kv_heads) * head_dim, config.max_num_seqs, int(decoder.vocab_size),
            width)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        blocks = kv_budget.blocks_for_device(total, free, config.gpu_memory_utilization,
                                             reserve, shape)
        logger.info("KV cache: %d blocks (%.2f GiB, %d tokens) from %g of the GPU's %.1f GiB, "
                    "%.2f GiB in use after the weights, %.2f GiB kept for activations", blocks,
                    blocks * shape.bytes_per_block / 2**30, blocks * config.block_size,
                    config.gpu_memory_utilization, total / 2**30, (total - free) / 2**30,
                    reserve / 2**30)
        return blocks

    def execute(self, step: StepInput) -> StepOutput | None:
        out = self.runner.execute(step)
        return out if self.rank == 0 else None

    def kv_blocks(self) -> int:
        return self.num_blocks

    def ping(self) -> int:
        return os.getpid()

    def node_id(self) -> str | None:
        """The Ray node this rank runs on (None outside Ray)."""
        import ray
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def weight_formats(self) -> dict[str, int]:
        return weight_formats(self.runner.model)

    def num_parameters(self) -> int:
        """Elements of the weights this rank holds (its shard)."""
        return sum(p.numel() for p in self.runner.model.parameters())
