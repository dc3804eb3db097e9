"""Block keys: unambiguous over salt, parent and tokens, chained into prefix keys; the router keys
blocks with the cache's own function."""

from __future__ import annotations

from replicas.block_hash import block_key, prefix_keys
from replicas.kv_cache import BlockManager
from replicas.request import GenerateRequest, SamplingParams, Sequence
from replicas.router import BLOCK, block_keys


def test_keys_are_unambiguous() -> None:
    root = block_key(None, [1], None)
    keys = [block_key(None, [1, 2], None), block_key(None, [1, 2], ""),
            block_key(None, [1, 2], "\x00"), block_key(None, [1, 2], "\x01"),
            block_key(None, [1, 2, 0], None), block_key(None, [258], None),
            block_key(None, [1, 2 + 2**32], None), block_key(root, [2], None),
            block_key(root, [2], ""), block_key(None, [2], "\x01" + "\x00" * 16)]
    assert len(set(keys)) == len(keys)
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert block_key(None, (1, 2), "s") == block_key(None, [1, 2], "s")  # tuples and lists alike


def test_prefix_keys_chain_block_keys() -> None:
    ids = list(range(40))
    chain = prefix_keys(ids, 16, "s")
    assert chain == [block_key(None, ids[:16], "s"), block_key(chain[0], ids[16:32], "s")]
    assert prefix_keys(tuple(ids), 16, "s") == chain
    assert prefix_keys(ids, 16, "s", max_blocks=1) == chain[:1]
    assert prefix_keys(ids[:15], 16, "s") == []
    assert prefix_keys(ids, 16, None) != chain


def test_the_router_keys_blocks_as_the_cache_does() -> None:
    ids = tuple(range(3, 3 + 3 * BLOCK + 5))
    request = GenerateRequest("r", ids, SamplingParams(max_tokens=1), cache_salt="t")
    blocks = BlockManager(num_blocks=16, block_size=BLOCK)
    seq = Sequence(0, "r", 0, list(ids), len(ids), SamplingParams(max_tokens=1), cache_salt="t")
    assert blocks.allocate(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    blocks.commit_full_blocks(seq, 0)
    assert block_keys(request) == [blocks.blocks[b].key for b in seq.block_table[:3]]
