"""CUDA graphs for decode-only steps: each step's ~1000 kernel launches replayed as one.

Without them a decode step of a small model on a GPU is host-bound: bench-135m at batch 32 on an
H100 spent 3.2 ms of a ~40 ms step in kernels, the rest launching them from Python. A graph per
(batch bucket, block-table width bucket) is captured when the worker starts, as vLLM does
(bench-135m: 78 graphs in 5.2 s on an H100): captured on first use instead, each new bucket stalled
serving for three eager forwards (9% of the replica's samples in one 256-stream profile, though the
run's throughput moved within its noise when they went). The graphs share one memory pool and write
their logits into one static buffer, so no graph's output pins pool memory; inputs live in static
buffers that each replay overwrites. Rows past the real batch are padding: they write their key and
value into a spare block no sequence owns (the worker allocates one past the block manager's) and
attend only to it.

Used only for steps whose every row adds one token, at tensor-parallel size 1 (a graph cannot hold
the actor round trips of tp > 1), on CUDA."""

from __future__ import annotations

import bisect
import itertools
import time

import torch

from replicas import host_tensors, kernels
from replicas.attention import AttentionMetadata, gather_fields

BatchSizes = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def _buckets(limit: int, sizes: tuple[int, ...]) -> list[int]:
    out = [s for s in sizes if s < limit]
    return [*out, limit]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int,
                 max_batch: int, max_blocks: int, pad_block: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.batch_buckets = _buckets(max_batch, BatchSizes)
        self.width_buckets = _buckets(max_blocks, tuple(2 ** i for i in range(20)))
        self.pad_block = pad_block
        dev = self.device
        long = {"dtype": torch.long, "device": dev}
        self.input_ids = torch.zeros(max_batch, **long)
        self.positions = torch.zeros(max_batch, **long)
        self.slot_mapping = torch.zeros(max_batch, **long)
        self.tables = torch.zeros(max_batch, max_blocks, **long)
        self.lens = torch.ones(max_batch, **long)
        kv_heads, slots, dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
        self.native = kernels.supports_paged_decode(kv_cache.dtype, dev)
        heads = torch.arange(kv_heads, device=dev)
        self.head_offsets = (heads * (slots // block_size)).unsqueeze(1)
        # the torch path's gather target; the Triton kernel reads the cache in place
        self.workspace = (None if self.native else
                          torch.empty(2, kv_heads * max_batch * max_blocks * block_size * dim,
                                      dtype=kv_cache.dtype, device=dev))
        self.max_batch = max_batch
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool: object | None = None
        self.logits: torch.Tensor | None = None  # [max_batch, vocab] float32, every graph's output

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.batch_buckets[-1] and width <= self.width_buckets[-1]

    def _meta(self, b: int, w: int) -> AttentionMetadata:
        """The step's attention metadata, computed on the device from the static buffers, so the
        captured graph recomputes it from whatever the buffers hold at replay."""
        tables = self.tables[:b, :w]
        lens = self.lens[:b]
        gather = {} if self.native else gather_fields(
            tables, lens, self.head_offsets, self.block_size, self.workspace[0],
            self.workspace[1])
        return AttentionMetadata(
            self.slot_mapping[:b], (), self.block_size,
            decode_token_index=torch.arange(b, device=self.device),
            decode_block_tables=tables, decode_context_lens=lens, native_decode=self.native,
            **gather)

    def _forward(self, b: int, w: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_cache,
                            self._meta(b, w))
        return self.model.compute_logits(hidden)

    def capture_all(self) -> float:
        """Every (batch, width) bucket's graph, largest first (the smaller ones then fit in the
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
            for _ in range(2 if self.logits is None else 1):
                out = self._forward(b, w)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.logits is None:
            self.logits = torch.empty(self.max_batch, out.shape[-1], dtype=torch.float32,
                                      device=self.device)
        del out
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[:b].copy_(self._forward(b, w))
        self.pool = graph.pool()
        return graph

    def _pad(self, start: int, end: int) -> None:
        if end <= start:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self.pad_block * self.block_size
        self.tables[start:end] = self.pad_block
        self.lens[start:end] = 1

    def _fill(self, packed: torch.Tensor, rows: torch.Tensor, b: int) -> None:
        """This step's rows into the static buffers, padding after them up to the bucket b."""
        n, w = rows.shape
        self.input_ids[:n], self.positions[:n] = packed[0], packed[1]
        self.slot_mapping[:n], self.lens[:n] = packed[2], packed[3]
        self.tables[:n, :w] = rows
        self._pad(n, b)

    @torch.no_grad()
    def run(self, ids: list[int], positions: list[int], slots: list[int],
            tables: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """Logits [len(ids), V] float32 on the device, for one decode token per row; `tables`:
        [rows, width] int64 on the host, the rows' block tables (cells past a table's end hold
        the padding block)."""
        n, width = tables.shape
        b = self.batch_buckets[bisect.bisect_left(self.batch_buckets, n)]
        w = self.width_buckets[bisect.bisect_left(self.width_buckets, width)]
        packed = host_tensors.int64(itertools.chain(ids, positions, slots, lens)).view(4, n).to(
            self.device, non_blocking=True)
        if w > width:
            tables = torch.nn.functional.pad(tables, (0, w - width), value=self.pad_block)
        rows = tables.to(self.device, non_blocking=True)
        self._fill(packed, rows, b)
        self.graphs[b, w].replay()  # every bucket was captured when the worker started
        assert self.logits is not None  # set by the first capture
        return self.logits[:n]

