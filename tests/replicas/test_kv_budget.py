"""The KV cache's size: --kv-cache-gib, or on GPUs what --gpu-memory-utilization leaves beside
the weights (vLLM's sizing; the arithmetic here, the device's numbers on a GPU), 0.5 GiB on
CPUs; always between one full-length sequence and every slot full-length."""

from __future__ import annotations

import pytest
import torch

from replicas import kv_budget
from replicas.deployment import LLMServer, ReplicaConfig
from replicas.embedded import EMBEDDED_MODEL_ID

GIB = 2**30
SHAPE = kv_budget.BlockShape(bytes_per_block=2**20, blocks_per_seq=8, max_num_seqs=1000)


def test_a_size_in_gib_is_clamped_to_one_sequence_and_every_slot() -> None:
    assert kv_budget.blocks_for_gib(1.0, SHAPE) == 1024
    assert kv_budget.blocks_for_gib(0.001, SHAPE) == 8  # one full-length sequence at least
    few_slots = kv_budget.BlockShape(2**20, blocks_per_seq=8, max_num_seqs=4)
    assert kv_budget.blocks_for_gib(100.0, few_slots) == 32  # more would only cache prefixes


def test_a_gpu_s_cache_is_its_utilization_less_what_is_in_use_and_the_activations() -> None:
    # 80 GiB, 12 in use (context, weights, another process): 0.9 * 80 - 12 - 2 = 58 GiB
    blocks = kv_budget.blocks_for_device(80 * GIB, 68 * GIB, 0.9, 2 * GIB, SHAPE)
    assert blocks == 1000 * 8  # capped at every slot full-length: 7.8 GiB of the 58
    uncapped = kv_budget.BlockShape(2**20, 8, 10**6)
    assert kv_budget.blocks_for_device(80 * GIB, 68 * GIB, 0.9, 2 * GIB, uncapped) == 58 * 1024
    assert kv_budget.blocks_for_device(80 * GIB, 68 * GIB, 0.5, 2 * GIB, uncapped) == 26 * 1024
    # a GPU shared past the utilization: not one sequence fits, and the error says what to change
    with pytest.raises(ValueError, match="--gpu-memory-utilization") as err:
        kv_budget.blocks_for_device(80 * GIB, 10 * GIB, 0.9, 2 * GIB, SHAPE)
    assert "--max-model-len" in str(err.value) and "--kv-cache-gib" in str(err.value)


def test_the_activation_reserve_grows_with_the_prefill_chunk_and_the_sampled_rows() -> None:
    small = kv_budget.activation_reserve(2048, 576, 1536, 960, 64, 49152, 2)
    assert small > 512 * 2**20  # never less than the fixed slack
    assert kv_budget.activation_reserve(8192, 576, 1536, 960, 64, 49152, 2) > small
    assert kv_budget.activation_reserve(2048, 576, 1536, 960, 256, 49152, 2) > small


def test_the_size_in_gib_is_the_flag_else_the_cpu_default_else_the_gpu_s_memory() -> None:
    assert kv_budget.cache_gib(2.0, on_gpu=True) == kv_budget.cache_gib(2.0, on_gpu=False) == 2.0
    assert kv_budget.cache_gib(0.0, on_gpu=False) == 0.0  # the least: one full-length sequence
    assert kv_budget.cache_gib(None, on_gpu=False) == kv_budget.CPU_KV_CACHE_GIB
    assert kv_budget.cache_gib(None, on_gpu=True) is None


def _cache_tokens(**config: object) -> int:
    """The KV cache's tokens of an in-process engine over the embedded model (max_model_len 128)."""
    server = LLMServer(ReplicaConfig(model=EMBEDDED_MODEL_ID, max_model_len=128, **config),
                       in_process=True)
    try:
        return server.info()["kv_cache_tokens"]
    finally:
        server.close()


def test_the_engine_sizes_its_cache_by_the_rule_where_it_runs() -> None:
    """Unset, a CPU replica takes 0.5 GiB (here more than 4 slots of 128 tokens: the cap), a
    GPU replica what the device's memory leaves; set, the size asked for."""
    assert ReplicaConfig(model=EMBEDDED_MODEL_ID).kv_cache_gib is None
    assert _cache_tokens(max_num_seqs=4) == 4 * 128
    if torch.cuda.is_available():
        return
    # 0: the least there is, one full-length sequence (the preemption tests' budget)
    assert _cache_tokens(max_num_seqs=4, kv_cache_gib=0.0) == 128
    # 0.01 GiB of this model's per-token K and V, in whole 16-token blocks
    tokens = _cache_tokens(max_num_seqs=64, kv_cache_gib=0.01)
    assert 128 < tokens < 64 * 128 and tokens % 16 == 0


def test_a_tokens_kv_bytes_are_every_layers_keys_and_values() -> None:
    # bench-135m: 30 layers, 3 KV heads of 64, a bf16 cache
    assert kv_budget.kv_bytes_per_token(30, 3, 64, 2) == 2 * 30 * 3 * 64 * 2 == 23_040
