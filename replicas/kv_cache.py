"""Paged KV-cache bookkeeping: fixed-size blocks, a block table per sequence, prefix sharing.

Only ids and counts live here; the tensors live on the shard workers. A full block is identified by
a cryptographic key over its tokens, its predecessor's key and the request's `cache_salt`
(replicas/block_hash.py), so a new sequence whose prompt starts with the same blocks (in the same
tenant) reuses them; a hit must also carry the very same token ids, so no crafted key collision can
hand one tenant another's KV. Freed blocks keep their key until reallocated, so a finished
conversation's prefix stays reusable (LRU)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from replicas.block_hash import BlockKey, block_key
from replicas.request import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None
    token_ids: tuple[int, ...] = ()  # what the key stands for, compared on every hit


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockKey, int] = {}  # block key -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def match_prefix(self, seq: Sequence) -> None:
        """Attaches cached blocks of the prompt's prefix to a sequence that has computed nothing."""
        # prompt logprobs need logits of every prompt position, so such a prompt is computed whole
        if not self.enable_prefix_caching or seq.block_table or seq.prompt_logprobs is not None:
            return
        bs = self.block_size
        prev: BlockKey | None = None
        # keep the last prompt token uncached so the step that follows has something to compute
        for i in range((seq.num_prompt_tokens - 1) // bs):
            tokens = seq.key_tokens(i * bs, (i + 1) * bs)
            key = block_key(prev, tokens, seq.cache_salt)
            block_id = self.cached.get(key)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            prev = key
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * bs

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grows the block table to hold `num_new_tokens` more tokens; False if blocks run out."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self.free):
            return False
        for _ in range(need):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None and self.cached.get(block.key) == block_id:
                del self.cached[block.key]
            block.key, block.token_ids = None, ()
            block.ref_count = 1
            seq.block_table.append(block_id)
        return True

    def commit_full_blocks(self, seq: Sequence, num_computed_before: int) -> None:
        """Publishes the keys of blocks that the last step filled, for later prefix matches."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(num_computed_before // bs, seq.num_computed_tokens // bs):
            block = self.blocks[seq.block_table[i]]
            if block.key is not None:
                continue
            prev = self.blocks[seq.block_table[i - 1]].key if i > 0 else None
            block.token_ids = seq.key_tokens(i * bs, (i + 1) * bs)
            block.key = block_key(prev, block.token_ids, seq.cache_salt)
            self.cached.setdefault(block.key, block.block_id)

    def free_sequence(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                # freed tail first: a sequence's tail is less likely shared than its head, so
                # it is reallocated (evicted) first
                self.free[block_id] = None
        seq.block_table.clear()
        seq.table_epoch += 1
        seq.num_computed_tokens = 0
