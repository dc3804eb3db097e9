"""How many KV-cache blocks a shard allocates: `--kv-cache-gib` where it is given, else on a GPU
what is left of `--gpu-memory-utilization` of the device's memory once the weights are loaded
(vLLM's default sizing), and 0.5 GiB on CPUs (the host's memory is shared with everything else
on the node). Either way at least one full-length sequence and at most every sequence slot
full-length: past that, blocks only ever hold prefix-cache entries."""

from __future__ import annotations

from dataclasses import dataclass

CPU_KV_CACHE_GIB = 0.5
# what a forward's temporaries can fragment into beyond their estimate, and the decode graphs'
# memory pool (captured after the cache is allocated)
_SLACK_BYTES = 512 * 2**20


@dataclass(frozen=True)
class BlockShape:
    bytes_per_block: int  # every layer's K and V for block_size tokens, this shard's heads
    blocks_per_seq: int  # one sequence at max_model_len
    max_num_seqs: int

    def clamp(self, blocks: int) -> int:
        return max(self.blocks_per_seq, min(blocks, self.blocks_per_seq * self.max_num_seqs))


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Every layer's K and V for one token, over `kv_heads` heads (one shard's at tp > 1)."""
    return 2 * layers * kv_heads * head_dim * elem_bytes


def cache_gib(asked: float | None, on_gpu: bool) -> float | None:
    """The size in GiB a replica's cache takes: `--kv-cache-gib` where given (0: the least, one
    full-length sequence), else CPU_KV_CACHE_GIB on CPUs; None: from the GPU's memory."""
    return asked if asked is not None or on_gpu else CPU_KV_CACHE_GIB


def blocks_for_gib(gib: float, shape: BlockShape) -> int:
    return shape.clamp(int(gib * 2**30 // shape.bytes_per_block))


def activation_reserve(tokens: int, hidden: int, intermediate: int, qkv_width: int,
                       rows: int, vocab: int, dtype_bytes: int) -> int:
    """Bytes a step's temporaries may take at once: a prefill chunk of `tokens` holds its hidden
    states, residual, projections and MLP inputs of one layer (doubled for the allocator's
    fragmentation), and `rows` sampled rows hold float32 logits and probabilities."""
    per_token = 3 * hidden + 2 * qkv_width + 3 * intermediate
    return 2 * tokens * per_token * dtype_bytes + 2 * rows * vocab * 4 + _SLACK_BYTES


def blocks_for_device(total: int, free: int, utilization: float, reserve: int,
                      shape: BlockShape) -> int:
    """Blocks that fit in `utilization` of a device of `total` bytes with `free` bytes free now
    (after the weights: everything else in use, this process's or another's, counts against the
    budget), less `reserve` for the step's temporaries. Raises ValueError when not even one
    full-length sequence fits."""
    budget = utilization * total - (total - free) - reserve
    blocks = int(budget // shape.bytes_per_block)
    if blocks < shape.blocks_per_seq:
        gib = 2**30
        raise ValueError(
            f"the KV cache does not fit: {utilization:g} of the GPU's {total / gib:.1f} GiB "
            f"(--gpu-memory-utilization) less {(total - free) / gib:.2f} GiB in use after "
            f"loading the weights and {reserve / gib:.2f} GiB for a step's activations leaves "
            f"{max(budget, 0) / gib:.2f} GiB, less than one sequence of --max-model-len "
            f"({shape.blocks_per_seq * shape.bytes_per_block / gib:.2f} GiB): raise "
            "--gpu-memory-utilization, lower --max-model-len or --max-num-batched-tokens, or "
            "set --kv-cache-gib")
    return shape.clamp(blocks)
