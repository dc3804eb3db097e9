"""CUDA graphs for steps of up to 1,024 tokens: a step's ~300-1000 kernel launches replayed as
one.

Without them a step of a small model on a GPU is host-bound: bench-135m at batch 32 on an H100
spent 3.2 ms of a ~40 ms step in kernels, the rest launching them from Python. A graph per
(token bucket, block-table width bucket) is captured when the worker starts, as vLLM does
(bench-135m: 108-162 graphs in 5.5-8.6 s on an H200): captured on first use instead, each new
bucket stalled serving for three eager forwards. The graphs share one memory pool and write their
last hidden states into one static buffer, so no graph's output pins pool memory (the runner
computes the logits of the rows that sample from it); inputs live in static buffers that each
replay overwrites. Rows past the real tokens are padding: they write their key and value into a
spare block no sequence owns (the worker allocates one past the block manager's) and attend only
to it.

Every token is attended as a decode row of its own, its context the cache slots of its sequence's
positions up to it (its own key and value are stored before the layer attends), so a step that
mixes decode rows with prompt chunks has the shape of a decode step of as many rows as tokens and
replays the same graphs. That is what serving needs: with requests arriving one by one most
steps carry a prompt chunk (an H200 at 256 streams: TPOT p50 11.8 ms against a 3.7 ms replayed
decode step, the chunked steps eager), and vLLM's piecewise graphs answer the same. Mixed steps
need the paged kernel (`kernels.supports_paged_decode`: Triton), which reads each row's keys in
place; the torch path's gather would copy every token's context.

Used at tensor-parallel size 1 (a graph cannot hold the actor round trips of tp > 1), on CUDA."""

from __future__ import annotations

import bisect
import time

import numpy as np
import torch

from replicas import kernels
from replicas.attention import AttentionMetadata, gather_fields

BatchSizes = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 640, 768, 1024)
# the most tokens a mixed step replays (beyond max_num_seqs): 256 streams' decode rows beside a
# few arriving 128-token prompts
MIXED_TOKENS = 1024
# the most keys a mixed step's prompt tokens may read between them (each reads its whole context):
# what 256 decode rows at 1,024 tokens read. Past it (long chunks, long cached prefixes) flash
# attention's shared reads win and the step runs eagerly
MIXED_KEYS = 1 << 18


def _buckets(limit: int, sizes: tuple[int, ...]) -> list[int]:
    out = [s for s in sizes if s < limit]
    return [*out, limit]


def graph_tokens(max_num_seqs: int, max_num_batched_tokens: int, mixed: bool) -> int:
    """The largest step the graphs hold: every decode batch, and with `mixed` steps of up to
    MIXED_TOKENS tokens where a step can hold that many."""
    if not mixed:
        return max_num_seqs
    return max(max_num_seqs, min(max_num_batched_tokens, MIXED_TOKENS))


class StepGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_blocks: int,
                 pad_block: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        dev = self.device
        self.native = kernels.supports_paged_decode(kv_cache.dtype, dev)
        max_tokens = graph_tokens(max_num_seqs, max_num_batched_tokens, self.mixed)
        self.batch_buckets = _buckets(max_tokens, BatchSizes)
        self.width_buckets = _buckets(max_blocks, tuple(2 ** i for i in range(20)))
        self.pad_block = pad_block
        long = {"dtype": torch.long, "device": dev}
        # ids, positions, slots and context lengths, one row each: filled by one copy a step
        self.packed = torch.zeros(4, max_tokens, **long)
        self.tables = torch.zeros(max_tokens, max_blocks, **long)
        kv_heads, slots, dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
        heads = torch.arange(kv_heads, device=dev)
        self.head_offsets = (heads * (slots // block_size)).unsqueeze(1)
        # a padding row: token 0 at position 0, its key and value into the spare block
        self.pad_row = torch.tensor([[0], [0], [pad_block * block_size], [1]], **long)
        # the torch path's gather target; the Triton kernel reads the cache in place
        self.workspace = (None if self.native else
                          torch.empty(2, kv_heads * max_tokens * max_blocks * block_size * dim,
                                      dtype=kv_cache.dtype, device=dev))
        self.max_tokens = max_tokens
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool: object | None = None
        self.hidden: torch.Tensor | None = None  # [max_tokens, hidden]: every graph's output

    @property
    def mixed(self) -> bool:
        """Whether steps with prompt tokens replay too: only through the paged kernel (module
        docstring)."""
        return self.native

    def fits(self, tokens: int, width: int) -> bool:
        return tokens <= self.batch_buckets[-1] and width <= self.width_buckets[-1]

    def _meta(self, b: int, w: int) -> AttentionMetadata:
        """The step's attention metadata, computed on the device from the static buffers, so the
        captured graph recomputes it from whatever the buffers hold at replay."""
        tables = self.tables[:b, :w]
        lens = self.packed[3, :b]
        gather = {} if self.native else gather_fields(
            tables, lens, self.head_offsets, self.block_size, self.workspace[0],
            self.workspace[1])
        return AttentionMetadata(
            self.packed[2, :b], (), self.block_size,
            decode_token_index=torch.arange(b, device=self.device),
            decode_block_tables=tables, decode_context_lens=lens, native_decode=self.native,
            **gather)

    def _forward(self, b: int, w: int) -> torch.Tensor:
        return self.model(self.packed[0, :b], self.packed[1, :b], self.kv_cache,
                          self._meta(b, w))

    def capture_all(self) -> float:
        """Every (tokens, width) bucket's graph, largest first (the smaller ones then fit in the
        pool the first grew); returns the seconds it took."""
        started = time.perf_counter()
        for b in reversed(self.batch_buckets):
            for w in reversed(self.width_buckets):
                if (b, w) not in self.graphs:
                    self.graphs[b, w] = self._capture(b, w)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def _capture(self, b: int, w: int) -> torch.cuda.CUDAGraph:
        # padding state in the buffers: a warm-up run must not write into a live block
        self._pad(0, b)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # lazy initialisations outside the graph: cuBLAS handles on the first capture,
            # Triton's compile for a new shape on every one
            for _ in range(2 if self.hidden is None else 1):
                out = self._forward(b, w)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.hidden is None:
            self.hidden = torch.empty(self.max_tokens, out.shape[-1], dtype=out.dtype,
                                      device=self.device)
        del out
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.hidden[:b].copy_(self._forward(b, w))
        self.pool = graph.pool()
        return graph

    def _pad(self, start: int, end: int) -> None:
        if end <= start:
            return
        self.packed[:, start:end] = self.pad_row
        self.tables[start:end] = self.pad_block

    @torch.no_grad()
    def run(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            tables: np.ndarray) -> torch.Tensor:
        """The last hidden states [len(ids), hidden] on the device (a view of the static buffer
        the next replay overwrites), one row per token: int64 arrays of each token's id, position
        and cache slot, and `tables` [tokens, width] its sequence's block table (cells past a
        table's end hold the padding block). A token attends to the positions up to its own."""
        n, width = tables.shape
        b = self.batch_buckets[bisect.bisect_left(self.batch_buckets, n)]
        w = self.width_buckets[bisect.bisect_left(self.width_buckets, width)]
        packed = np.stack((ids, positions, slots, positions + 1))
        self.packed[:, :n].copy_(torch.from_numpy(packed), non_blocking=True)
        if w > width:
            tables = np.pad(tables, ((0, 0), (0, w - width)), constant_values=self.pad_block)
        self.tables[:n, :w].copy_(torch.from_numpy(tables), non_blocking=True)
        self._pad(n, b)
        self.graphs[b, w].replay()  # every bucket was captured when the worker started
        assert self.hidden is not None  # set by the first capture
        return self.hidden[:n]
