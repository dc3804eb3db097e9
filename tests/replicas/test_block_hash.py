"""Prefix-cache keys: two different blocks built to share Python's old `hash()` key no longer share
KV; cache_salt still isolates tenants; the router keys blocks with the cache's function; the
router's per-request bookkeeping does not outlive a request that is never routed."""

from __future__ import annotations

import asyncio
import types

import pytest

from replicas.block_hash import block_key, prefix_keys
from replicas.kv_cache import BlockManager
from replicas.request import GenerateRequest, SamplingParams, Sequence
from replicas.router import BLOCK, PrefixAffinityRouter, block_keys

M64 = 2**64
P1, P2, P5 = 11400714785074694791, 14029467366897019727, 2870177450012600261


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) % M64


def _tuple_acc(items: list[int]) -> int:
    """CPython's tuple hash accumulator (xxHash-style, 3.8+) before the length is mixed in."""
    acc = P5
    for item in items:
        acc = _rotl((acc + hash(item) * P2) % M64, 31) * P1 % M64
    return acc


def _tuple_hash(items: list[int]) -> int:
    acc = (_tuple_acc(items) + (len(items) ^ (P5 ^ 3527539))) % M64
    if acc == M64 - 1:
        return 1546275796
    return acc - M64 if acc >= 2**63 else acc


def colliding_blocks(size: int = 16) -> tuple[list[int], list[int]]:
    """Two different blocks of non-negative token ids whose Python tuple hashes are equal: the
    same length and the same last item's contribution once the accumulators meet, i.e.
    acc_a + hash(x) * P2 == acc_b + hash(y) * P2 (mod 2^64); pick y, solve for x, and try other
    second-to-last items until x is an int that is its own hash (one try in eight)."""
    inv_p2 = pow(P2, -1, M64)
    for other in range(2, 200):
        a_head, b_head = [7] * (size - 2) + [1], [7] * (size - 2) + [other]
        acc_a, acc_b = _tuple_acc(a_head), _tuple_acc(b_head)
        y = 5
        x = (y + (acc_b - acc_a) * inv_p2) % M64
        if x < 2**61 - 1:
            return a_head + [x], b_head + [y]
    raise AssertionError("no colliding pair found")


def test_the_tuple_hash_model_is_cpythons() -> None:
    for items in ([], [1], [5, 6, 7], list(range(16))):
        assert _tuple_hash(items) == hash(tuple(items))


def _seq(seq_id: int, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), len(tokens),
                    SamplingParams(max_tokens=4), cache_salt=salt)


def _cache_prompt(blocks: BlockManager, seq: Sequence) -> None:
    """As the engine does: allocate the whole prompt, compute it, publish its full blocks."""
    assert blocks.allocate(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    blocks.commit_full_blocks(seq, 0)


def test_blocks_with_the_same_old_hash_no_longer_share_kv() -> None:
    a, b = colliding_blocks()
    assert a != b and hash(tuple(a)) == hash(tuple(b))
    assert hash((None, None, tuple(a))) == hash((None, None, tuple(b)))  # the old key
    assert block_key(None, a, None) != block_key(None, b, None)

    blocks = BlockManager(num_blocks=16, block_size=16)
    owner = _seq(0, a + [3, 4, 5])  # one full block, then the tail
    _cache_prompt(blocks, owner)
    intruder = _seq(1, b + [3, 4, 5])
    blocks.match_prefix(intruder)
    assert intruder.num_cached_tokens == 0 and intruder.block_table == []
    same = _seq(2, a + [9])  # a real hit still hits
    blocks.match_prefix(same)
    assert same.num_cached_tokens == 16 and same.block_table == owner.block_table[:1]


def test_a_key_collision_still_needs_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even if two blocks' digests collided, a hit compares the tokens themselves."""
    import replicas.kv_cache as kv
    monkeypatch.setattr(kv, "block_key", lambda parent, tokens, salt: b"same")
    blocks = BlockManager(num_blocks=8, block_size=4)
    _cache_prompt(blocks, _seq(0, [1, 2, 3, 4, 5]))
    other = _seq(1, [1, 2, 3, 5, 5])
    blocks.match_prefix(other)
    assert other.num_cached_tokens == 0


def test_cache_salt_isolates_tenants() -> None:
    tokens = list(range(100, 133))
    blocks = BlockManager(num_blocks=16, block_size=16)
    _cache_prompt(blocks, _seq(0, tokens, salt="tenant-a"))
    for seq_id, salt, cached in ((1, "tenant-b", 0), (2, None, 0), (3, "", 0),
                                 (4, "tenant-a", 32)):
        seq = _seq(seq_id, tokens + [1], salt)
        blocks.match_prefix(seq)
        assert seq.num_cached_tokens == cached, salt


def test_keys_are_unambiguous() -> None:
    keys = {block_key(None, [1, 2], None), block_key(None, [1, 2], ""),
            block_key(None, [1, 2], "\x00"), block_key(None, [1, 2, 0], None),
            block_key(None, [258], None), block_key(block_key(None, [1], None), [2], None)}
    assert len(keys) == 6
    assert block_key(None, (1, 2), "s") == block_key(None, [1, 2], "s")
    chain = prefix_keys(list(range(40)), 16, "s")
    assert len(chain) == 2 and chain[1] == block_key(chain[0], list(range(16, 32)), "s")


def test_the_router_keys_blocks_as_the_cache_does() -> None:
    ids = tuple(range(3, 3 + 3 * BLOCK + 5))
    request = GenerateRequest("r", ids, SamplingParams(max_tokens=1), cache_salt="t")
    blocks = BlockManager(num_blocks=16, block_size=BLOCK)
    seq = _seq(0, list(ids), "t")
    _cache_prompt(blocks, seq)
    cache_keys = [blocks.blocks[b].key for b in seq.block_table[:3]]
    assert block_keys(request) == cache_keys


def _pending(request: GenerateRequest, rid: str) -> types.SimpleNamespace:
    loop = asyncio.new_event_loop()
    return types.SimpleNamespace(args=[request], kwargs={}, future=loop.create_future(),
                                 metadata=types.SimpleNamespace(internal_request_id=rid))


def test_a_request_never_routed_leaves_no_entry() -> None:
    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)
    router.initialize_state()
    replica = types.SimpleNamespace(replica_id="rep-1")
    request = GenerateRequest("r", tuple(range(40)), SamplingParams(max_tokens=1))
    routed, cancelled = _pending(request, "a"), _pending(request, "b")
    for p in (routed, cancelled):
        asyncio.run(router.choose_replicas([replica], p))
    assert set(router.pending_keys) == {"a", "b"}
    router.on_request_routed(routed, "rep-1", None)
    assert set(router.pending_keys) == {"b"}
    cancelled.future.cancel()  # cancelled while queued: on_request_routed never comes
    cancelled.future.get_loop().run_until_complete(asyncio.sleep(0))  # run done-callbacks
    assert router.pending_keys == {}
    assert router._match("rep-1", block_keys(request)) == 2
