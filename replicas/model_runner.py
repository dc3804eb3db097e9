"""One step on one shard: step description -> tensors -> forward -> logits of the sampled positions.

`StepInput` is what the executor sends every rank each step; it carries token ids and block tables
only. Rank 0's runner returns the logits of the rows that sample (and of every prompt position for
rows that asked for prompt logprobs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replicas.attention import AttentionMetadata, PrefillRow


@dataclass(frozen=True)
class RowInput:
    token_ids: tuple[int, ...]  # the tokens this step computes for the row
    start: int  # position of the first of them
    block_table: tuple[int, ...]
    sample: bool  # the row's last token is new: return its logits
    all_logits: bool = False  # return logits of every computed position (prompt logprobs)


@dataclass(frozen=True)
class StepInput:
    rows: tuple[RowInput, ...]


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor  # [num sampled rows, V] float32, in row order
    # per row asking for all logits: [num tokens, V] float32 (positions start..start+n-1)
    all_logits: tuple[torch.Tensor | None, ...]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int) -> None:
        self.model = model
        self.device = kv_cache.device
        self.kv_cache = kv_cache
        self.block_size = block_size

    def _slots(self, block_table: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        positions: list[int] = []
        slot_parts: list[torch.Tensor] = []
        decode_index: list[int] = []
        decode_tables: list[tuple[int, ...]] = []
        decode_lens: list[int] = []
        prefill: list[PrefillRow] = []
        for row in step.rows:
            n = len(row.token_ids)
            offset = len(ids)
            ids.extend(row.token_ids)
            positions.extend(range(row.start, row.start + n))
            slot_parts.append(self._slots(row.block_table, row.start, row.start + n))
            if n == 1:
                decode_index.append(offset)
                decode_tables.append(row.block_table)
                decode_lens.append(row.start + 1)
            else:
                ctx = None if row.start == 0 else self._slots(row.block_table, 0, row.start + n)
                prefill.append(PrefillRow(offset, offset + n, ctx))
        meta_decode: tuple = (None, None, None)
        if decode_index:
            bs = self.block_size
            width = max(len(t) for t in decode_tables)
            tables = torch.tensor([t + (0,) * (width - len(t)) for t in decode_tables])
            slots = (tables.unsqueeze(-1) * bs + torch.arange(bs)).flatten(1)  # [Bd, width*bs]
            kmax = max(decode_lens)
            slots = slots[:, :kmax]
            mask = torch.arange(kmax).unsqueeze(0) < torch.tensor(decode_lens).unsqueeze(1)
            meta_decode = (torch.tensor(decode_index), slots, mask[:, None, None, :])
        meta = AttentionMetadata(torch.cat(slot_parts), *meta_decode, tuple(prefill))
        if self.device.type != "cpu":
            meta = _to_device(meta, self.device)
        return (torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                meta)

    @torch.no_grad()
    def execute(self, step: StepInput) -> StepOutput:
        input_ids, positions, meta = self.prepare(step)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        sample_index: list[int] = []
        spans: list[tuple[int, int] | None] = []
        offset = 0
        for row in step.rows:
            n = len(row.token_ids)
            if row.sample:
                sample_index.append(offset + n - 1)
            spans.append((offset, offset + n) if row.all_logits else None)
            offset += n
        logits = self.model.compute_logits(hidden[sample_index]).float().cpu()
        all_logits = tuple(
            None if span is None
            else self.model.compute_logits(hidden[span[0]:span[1]]).float().cpu()
            for span in spans)
        return StepOutput(logits, all_logits)


def _to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)
    rows = tuple(PrefillRow(r.start, r.end, move(r.context_slots)) for r in meta.prefill_rows)
    return AttentionMetadata(move(meta.slot_mapping), move(meta.decode_token_index),
                             move(meta.decode_context_slots), move(meta.decode_mask), rows)
