"""One step on one shard: step description -> tensors -> forward -> logits of the sampled positions.

`StepInput` is what the executor sends every rank each step, a delta: each row's tokens to
compute and the blocks its table gained since the runner last saw it (the whole table the first
time), and the sequences whose tables the runner drops; for a multimodal model also the media
items whose placeholder tokens the step computes. Each runner keeps the tables it was given in
one array between steps (`block_tables.BlockTables`), so a decoding row crosses to the shards as
one token and, once a block, one block id, never its whole table, and a step's tensors are built
from that array in a few array operations over all its tokens, not per row. Rank 0's runner
returns the logits of the rows that sample (and of every prompt position for rows that asked
for prompt logprobs).

Media items are encoded at most once while they stay in a bounded LRU cache of encoder outputs
(keyed by `MultiModalItem.key`): chunked prefill reads an image's rows over several steps, and
requests sharing an image share its rows. Each step encodes all its missing items in one
`model.encode` call per modality, batched across rows. Every rank encodes on its own (the
encoders are replicated); a step with media runs eagerly (CUDA graphs take token ids only).
A model with M-RoPE (`uses_mrope`, Qwen2.5-VL) takes [3, T] positions: each row's `mrope`, or its
text positions on all three axes where it has none."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from replicas import host_tensors, kernels
from replicas.attention import (
    AttentionMetadata,
    PrefillRow,
    VarlenPrefill,
    gather_fields,
    supports_varlen_prefill,
)
from replicas.block_tables import BlockTables
from replicas.cuda_graphs import MIXED_KEYS, StepGraphs
from replicas.request import MultiModalItem


@dataclass(frozen=True)
class EncoderSlice:
    """Encoder output rows [start, start + length) of `item` replace the embeddings of the row's
    tokens [offset, offset + length) (offsets into this step's `RowInput.token_ids`)."""

    item: MultiModalItem
    start: int
    length: int
    offset: int


def encoder_slices(items: Sequence[MultiModalItem], start: int,
                   end: int) -> tuple[EncoderSlice, ...]:
    """The parts of a prompt's media `items` whose placeholders lie in its tokens [start, end)."""
    out = []
    for item in items:
        lo, hi = max(start, item.offset), min(end, item.offset + item.length)
        if lo < hi:
            out.append(EncoderSlice(item, lo - item.offset, hi - lo, lo - start))
    return tuple(out)


class RowInput(NamedTuple):
    """One row of a step (a NamedTuple, not a frozen dataclass: the engine makes one per row
    per step, 0.8 against 1.7 us)."""

    token_ids: tuple[int, ...]  # the tokens this step computes for the row
    start: int  # position of the first of them
    # the blocks the row's table gained since the runner last saw `seq_id` (all of it the first
    # time); a row without a `seq_id` gives its whole table and the runner keeps nothing of it
    blocks: tuple[int, ...]
    sample: bool  # the row's last token is new: return its logits
    all_logits: bool = False  # return logits of every computed position (prompt logprobs)
    encoder: tuple[EncoderSlice, ...] = ()  # media placeholders among this step's tokens
    # a model with M-RoPE: the step's tokens' positions, int64 numpy [3, tokens]; None: every
    # axis counts start, start + 1, ... (text)
    mrope: Any = None
    seq_id: int | None = None


@dataclass(frozen=True)
class StepInput:
    rows: tuple[RowInput, ...]
    freed: tuple[int, ...] = ()  # sequences whose tables the runner drops before this step


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor  # [num sampled rows, V] float32, in row order
    # per row asking for all logits: [num tokens, V] float32 (positions start..start+n-1)
    all_logits: tuple[torch.Tensor | None, ...]
    # media items the step encoded, the seconds that took, and items the encoder cache had
    encoded: int = 0
    encoder_s: float = 0.0
    encoder_hits: int = 0


@dataclass(frozen=True)
class TokenLayout:
    """A step's tokens, row by row (int64 arrays): per step row its token count, first position
    and first token's index; per token its id, step row, position, row of the block tables and
    cache slot."""

    token_ids: np.ndarray
    counts: np.ndarray
    starts: np.ndarray
    offsets: np.ndarray
    token_row: np.ndarray
    positions: np.ndarray
    token_table: np.ndarray
    slot_mapping: np.ndarray

    @property
    def total(self) -> int:
        return len(self.positions)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int,
                 graphs: StepGraphs | None = None, logits_on_device: bool = False,
                 encoder_cache_rows: int = 16384, dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.multimodal = bool(getattr(model, "modalities", ()))
        # M-RoPE (Qwen2.5-VL): the model's positions are [3, T], from each row's `mrope`
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        # item key -> its encoder output [rows, hidden] on the device, least recently used first
        self.encoder_cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.encoder_cache_rows = encoder_cache_rows
        self._encoder_cached_rows = 0
        self.logits_on_device = logits_on_device
        self.graphs = graphs
        self.device = kv_cache.device
        self._workspace: torch.Tensor | None = None
        self.kv_cache = kv_cache
        self.block_size = block_size
        # dtype: the activations' (None: the cache's); a bf16 cache may hold float32 compute's
        self.dtype = kv_cache.dtype if dtype is None else dtype
        self.native_decode = kernels.supports_paged_decode(self.dtype, kv_cache.device,
                                                           kv_cache.dtype)
        # on CPUs every prefill token is attended as a decode row of its own (its context: the
        # positions up to it): the C kernel beat SDPA's causal flash attention at every prompt
        # length measured (137 tokens 1.8x, 512 1.45x, 2048 1.05x; bench-135m heads, 2 cores).
        # On GPUs prefill keeps flash attention (varlen or per row)
        self.native_prefill = self.native_decode and kv_cache.device.type == "cpu"
        self.varlen_prefill = supports_varlen_prefill(kv_cache.dtype, kv_cache.device)
        self.block_tables = BlockTables(pad=graphs.pad_block if graphs is not None else 0)

    def update_tables(self, step: StepInput) -> np.ndarray:
        """Applies the step's table deltas; the `block_tables` row of each step row, in order."""
        return self.block_tables.apply(step.freed, [(row.seq_id, row.blocks)
                                                    for row in step.rows])

    def _cache_slots(self, table_rows: np.ndarray | int, positions: np.ndarray) -> np.ndarray:
        """The cache slot of each position in its table (`block_tables` rows: one per position,
        or one for all of them)."""
        bs = self.block_size
        return self.block_tables.array[table_rows, positions // bs] * bs + positions % bs

    def layout(self, step: StepInput, table_rows: np.ndarray) -> TokenLayout:
        """Where each of the step's tokens sits (`table_rows`: each step row's table), computed
        for all of them at once from the persistent tables."""
        rows = step.rows
        n_rows = len(rows)
        counts = np.fromiter((len(r.token_ids) for r in rows), np.int64, n_rows)
        starts = np.fromiter((r.start for r in rows), np.int64, n_rows)
        offsets = np.cumsum(counts) - counts
        total = int(offsets[-1] + counts[-1]) if n_rows else 0
        if total == n_rows:  # decode only: a token a row
            token_row, positions = np.arange(n_rows), starts
        else:
            token_row = np.repeat(np.arange(n_rows), counts)  # each token's step row
            positions = np.arange(total, dtype=np.int64) + (starts - offsets)[token_row]
        token_table = table_rows[token_row]  # each token's row of the tables
        # np.fromiter: 0.5-0.7x the time of host_tensors.int64 over the same ids (AMD EPYC Zen 4)
        ids = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in rows), np.int64,
                          total)
        return TokenLayout(ids, counts, starts, offsets, token_row, positions, token_table,
                           self._cache_slots(token_table, positions))

    def prepare(self, step: StepInput, table_rows: np.ndarray, layout: TokenLayout | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's token ids, positions and attention metadata (`table_rows`: each step row's
        table; `layout`: its tokens', computed here if not given)."""
        if layout is None:
            layout = self.layout(step, table_rows)
        rows = step.rows
        n_rows = len(rows)
        counts, starts, offsets = layout.counts, layout.starts, layout.offsets
        token_row, positions = layout.token_row, layout.positions
        token_table, slot_mapping = layout.token_table, layout.slot_mapping
        total = layout.total
        # decode rows (one token), and on CPUs every prefill token too (`native_prefill`), are
        # attended as decode tokens; on GPUs prefill rows keep flash attention (varlen or per row)
        decode_row = (np.ones(n_rows, dtype=bool) if self.native_prefill else counts == 1)
        fields: dict = {}  # AttentionMetadata fields beyond the slot mapping
        bs = self.block_size
        decode_index = (np.arange(total, dtype=np.int64) if self.native_prefill
                        else np.flatnonzero(decode_row[token_row]))
        if decode_index.size:
            lens = positions[decode_index] + 1
            # only the blocks a row's context reaches: tables may hold blocks reserved ahead
            width = -(-int(lens.max()) // bs)
            block_rows = torch.from_numpy(
                self.block_tables.array[token_table[decode_index], :width])
            lens_t = torch.from_numpy(lens)
            fields = {"decode_token_index": torch.from_numpy(decode_index),
                      "decode_block_tables": block_rows, "decode_context_lens": lens_t,
                      "native_decode": self.native_decode}
            if not self.native_decode:
                kv_heads, slots = self.kv_cache.shape[2:4]
                heads = torch.arange(kv_heads).unsqueeze(1) * (slots // bs)
                k_buf, v_buf = self._gather_buffers(kv_heads * block_rows.numel() * bs
                                                    * self.kv_cache.shape[4])
                fields |= gather_fields(block_rows, lens_t, heads, bs, k_buf, v_buf)
        prefill: list[PrefillRow] = []
        # varlen prefill: the prefill rows' flat positions and their contexts' cache slots
        prefill_index: list[np.ndarray] = []
        kv_slots: list[np.ndarray] = []
        cu_q, cu_k = [0], [0]
        for i in np.flatnonzero(~decode_row).tolist():
            offset, n, start = int(offsets[i]), int(counts[i]), int(starts[i])
            if self.varlen_prefill:
                prefill_index.append(np.arange(offset, offset + n, dtype=np.int64))
                kv_slots += [self._cache_slots(int(table_rows[i]), np.arange(start)),
                             slot_mapping[offset:offset + n]]
                cu_q.append(cu_q[-1] + n)
                cu_k.append(cu_k[-1] + start + n)
                prefill.append(PrefillRow(offset, offset + n, None))
            else:
                ctx = (None if start == 0 else torch.from_numpy(
                    self._cache_slots(int(table_rows[i]), np.arange(start + n))))
                prefill.append(PrefillRow(offset, offset + n, ctx))
        if prefill_index:
            fields["prefill_varlen"] = VarlenPrefill(
                torch.from_numpy(np.concatenate(prefill_index)),
                torch.from_numpy(np.concatenate(kv_slots)),
                torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
                max(b - a for a, b in itertools.pairwise(cu_q)),
                max(b - a for a, b in itertools.pairwise(cu_k)))
        meta = AttentionMetadata(torch.from_numpy(slot_mapping), tuple(prefill), self.block_size,
                                 **fields)
        if self.device.type != "cpu":
            meta = _to_device(meta, self.device)
        pos = (self._mrope_positions(step) if self.uses_mrope
               else torch.from_numpy(positions))
        return torch.from_numpy(layout.token_ids).to(self.device), pos.to(self.device), meta

    @staticmethod
    def _mrope_positions(step: StepInput) -> torch.Tensor:
        """[3, T] int64: each row's `mrope` where set, else its text positions on all three axes
        (text tokens, and every token of a prompt without images)."""
        parts = []
        for row in step.rows:
            n = len(row.token_ids)
            if row.mrope is None:
                parts.append(np.broadcast_to(np.arange(row.start, row.start + n), (3, n)))
            elif row.mrope.shape != (3, n):
                raise ValueError(f"a row's M-RoPE positions must be [3, {n}] for its {n} tokens, "
                                 f"got {list(row.mrope.shape)}")
            else:
                parts.append(row.mrope)
        return torch.from_numpy(np.concatenate(parts, axis=1).astype(np.int64, copy=False))

    def _gather_buffers(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat workspaces of at least `numel` elements, grown (never shrunk) on demand."""
        if self._workspace is None or self._workspace.shape[1] < numel:
            self._workspace = torch.empty(2, int(numel * 1.25), dtype=self.kv_cache.dtype,
                                          device=self.device)
        return self._workspace[0], self._workspace[1]

    def _replay(self, step: StepInput, layout: TokenLayout) -> torch.Tensor | None:
        """The step's last hidden states through a CUDA graph; None where it does not fit one:
        more tokens than the graphs hold, media among them, or prompt tokens (mixed steps) where
        the graphs take none or their contexts would cost more than flash attention's reads
        (`cuda_graphs.MIXED_KEYS`)."""
        graphs = self.graphs
        if layout.total > graphs.max_tokens or (self.multimodal
                                                 and any(r.encoder for r in step.rows)):
            return None
        if layout.total > len(step.rows):
            prompt = layout.counts[layout.token_row] > 1
            if not graphs.mixed or int((layout.positions[prompt] + 1).sum()) > MIXED_KEYS:
                return None
        width = -(-(int(layout.positions.max()) + 1) // self.block_size)
        if not graphs.fits(layout.total, width):
            return None
        return graphs.run(layout.token_ids, layout.positions, layout.slot_mapping,
                          self.block_tables.array[layout.token_table, :width])

    @torch.no_grad()
    def execute(self, step: StepInput) -> StepOutput:
        table_rows = self.update_tables(step)
        layout = self.layout(step, table_rows)
        hidden = self._replay(step, layout) if self.graphs is not None else None
        counts = (0, 0.0, 0)
        if hidden is None:
            input_ids, positions, meta = self.prepare(step, table_rows, layout)
            if self.multimodal and any(row.encoder for row in step.rows):
                embeds, counts = self._embeds(step)
                hidden = self.model(input_ids, positions, self.kv_cache, meta, embeds=embeds)
            else:
                hidden = self.model(input_ids, positions, self.kv_cache, meta)
        ends = layout.offsets + layout.counts
        sample = np.fromiter((r.sample for r in step.rows), bool, len(step.rows))
        if sample.all() and layout.total == len(step.rows):  # decode rows that all sample
            sampled = hidden
        else:
            sampled = hidden[torch.from_numpy(ends[sample] - 1).to(hidden.device)]
        logits = self._sampled_logits(self.model.compute_logits(sampled).float())
        all_logits = tuple(
            self.model.compute_logits(hidden[start:end]).float().cpu() if row.all_logits
            else None
            for row, start, end in zip(step.rows, layout.offsets.tolist(), ends.tolist()))
        return StepOutput(logits, all_logits, *counts)

    def _embeds(self, step: StepInput) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                tuple[int, float, int]]:
        """(flat token index, encoder rows) of the step's media placeholders, and (items
        encoded, seconds encoding, items the cache had)."""
        outputs, counts = self._encoder_outputs([s.item for row in step.rows
                                                 for s in row.encoder])
        index: list[int] = []
        rows: list[torch.Tensor] = []
        offset = 0
        for row in step.rows:
            for s in row.encoder:
                index.extend(range(offset + s.offset, offset + s.offset + s.length))
                rows.append(outputs[s.item.key][s.start:s.start + s.length])
            offset += len(row.token_ids)
        return (host_tensors.int64(index).to(self.device), torch.cat(rows)), counts

    def _encoder_outputs(self, items: list[MultiModalItem]
                         ) -> tuple[dict[bytes, torch.Tensor], tuple[int, float, int]]:
        """Each item's encoder rows by key: cached ones, the others encoded in one call per
        modality and cached (the least recently used evicted past `encoder_cache_rows`); and
        (items encoded, seconds encoding, items the cache had)."""
        out: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, MultiModalItem] = {}
        hits = 0
        for item in items:
            if item.key in out or item.key in missing:
                continue
            given = item.data.get("embeds")
            if given is not None:  # the client's own encoder rows (--enable-mm-embeds)
                out[item.key] = torch.from_numpy(given).to(self.device)
                continue
            cached = self.encoder_cache.get(item.key)
            if cached is not None:
                self.encoder_cache.move_to_end(item.key)
                out[item.key] = cached
                hits += 1
            else:
                missing[item.key] = item
        by_modality: dict[str, list[MultiModalItem]] = {}
        for item in missing.values():
            by_modality.setdefault(item.modality, []).append(item)
        started = time.perf_counter()
        for modality, todo in by_modality.items():
            encoded = self.model.encode(modality, [item.data for item in todo])
            for item, rows in zip(todo, encoded):
                if rows.shape[0] != item.length:
                    raise ValueError(f"the {modality} encoder gives {rows.shape[0]} rows, the "
                                     f"prompt holds {item.length} placeholder tokens for it")
                out[item.key] = rows
                self._cache_encoder_output(item.key, rows)
        if missing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the seconds of the work, not of its launch
        return out, (len(missing), time.perf_counter() - started if missing else 0.0, hits)

    def _cache_encoder_output(self, key: bytes, rows: torch.Tensor) -> None:
        self.encoder_cache[key] = rows
        self._encoder_cached_rows += rows.shape[0]
        while self._encoder_cached_rows > self.encoder_cache_rows:
            _, evicted = self.encoder_cache.popitem(last=False)
            self._encoder_cached_rows -= evicted.shape[0]

    def _sampled_logits(self, logits: torch.Tensor) -> torch.Tensor:
        # on a GPU, sampling there moves B token ids to the host instead of B x vocab floats
        # and runs the sampler's full-vocabulary ops as kernels rather than on host cores
        return logits if self.logits_on_device else logits.cpu()


def _to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)
    rows = tuple(PrefillRow(r.start, r.end, move(r.context_slots)) for r in meta.prefill_rows)
    tensors = {f.name: move(getattr(meta, f.name)) for f in dataclasses.fields(meta)
               if f.name.startswith("decode_") and not f.name.endswith("_buffer")}
    pv = meta.prefill_varlen
    if pv is not None:
        tensors["prefill_varlen"] = dataclasses.replace(
            pv, token_index=move(pv.token_index), kv_slots=move(pv.kv_slots), cu_q=move(pv.cu_q),
            cu_k=move(pv.cu_k))
    return dataclasses.replace(meta, slot_mapping=move(meta.slot_mapping), prefill_rows=rows,
                               **tensors)
