"""The prefix cache's contract: a hit needs the same salt, the same prefix and the very same token
ids; two blocks built to share Python's old `hash()` key (the key before replicas/block_hash.py)
do not share KV; freed blocks stay reusable until they are reallocated, oldest freed first."""

from __future__ import annotations

import pytest

from replicas.block_hash import block_key, media_key_tokens
from replicas.kv_cache import BlockManager
from replicas.request import MultiModalItem, SamplingParams, Sequence

M64 = 2**64
P1, P2, P5 = 11400714785074694791, 14029467366897019727, 2870177450012600261


def _rotl31(x: int) -> int:
    return ((x << 31) | (x >> 33)) % M64


def _tuple_acc(items: list[int]) -> int:
    """CPython's tuple hash accumulator (xxHash-style, 3.8+) before the length is mixed in."""
    acc = P5
    for item in items:
        acc = _rotl31((acc + hash(item) * P2) % M64) * P1 % M64
    return acc


def _tuple_hash(items: list[int]) -> int:
    acc = (_tuple_acc(items) + (len(items) ^ (P5 ^ 3527539))) % M64
    if acc == M64 - 1:
        return 1546275796
    signed = acc - M64 if acc >= 2**63 else acc
    return -2 if signed == -1 else signed


def colliding_blocks(size: int = 16) -> tuple[list[int], list[int]]:
    """Two different blocks of non-negative token ids with equal Python tuple hashes. They differ
    in their last two items: after different second-to-last items the accumulators differ, and
    the last items x, y are solved so that acc_a + x * P2 == acc_b + y * P2 (mod 2^64); the other
    second-to-last item is varied until x < 2^61 - 1, an int that is its own hash."""
    inv_p2 = pow(P2, -1, M64)
    y = 5
    for other in range(2, 500):
        a_head, b_head = [7] * (size - 2) + [1], [7] * (size - 2) + [other]
        x = (y + (_tuple_acc(b_head) - _tuple_acc(a_head)) * inv_p2) % M64
        if x < 2**61 - 1:
            return a_head + [x], b_head + [y]
    raise AssertionError("no colliding pair found")


def _seq(seq_id: int, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), len(tokens),
                    SamplingParams(max_tokens=4), cache_salt=salt)


def _run_prompt(blocks: BlockManager, seq: Sequence) -> None:
    """As the engine does: match, allocate the rest of the prompt, compute it, publish blocks."""
    blocks.match_prefix(seq)
    before = seq.num_computed_tokens
    assert blocks.allocate(seq, len(seq) - before)
    seq.num_computed_tokens = len(seq)
    blocks.commit_full_blocks(seq, before)


def test_the_tuple_hash_model_is_cpythons() -> None:
    for items in ([], [1], [5, 6, 7], list(range(16)), [2**61, -1, 2**70]):
        assert _tuple_hash(items) == hash(tuple(items))


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_blocks_with_the_same_old_hash_do_not_share_kv(salt: str | None) -> None:
    a, b = colliding_blocks()
    assert a != b and len(a) == len(b) == 16
    assert hash(tuple(a)) == hash(tuple(b))
    assert hash((None, salt, tuple(a))) == hash((None, salt, tuple(b)))  # the old first-block key
    assert block_key(None, a, salt) != block_key(None, b, salt)

    blocks = BlockManager(num_blocks=16, block_size=16)
    owner = _seq(0, a + [3, 4, 5], salt)  # one full block, then a tail
    _run_prompt(blocks, owner)
    intruder = _seq(1, b + [3, 4, 5], salt)
    _run_prompt(blocks, intruder)
    assert intruder.num_cached_tokens == 0
    assert intruder.block_table[0] != owner.block_table[0]
    again = _seq(2, a + [9], salt)  # the owner's prompt again: a real hit
    blocks.match_prefix(again)
    assert again.num_cached_tokens == 16 and again.block_table == owner.block_table[:1]


def test_a_hit_compares_the_tokens_even_if_keys_collide(monkeypatch: pytest.MonkeyPatch) -> None:
    import replicas.kv_cache as kv
    monkeypatch.setattr(kv, "block_key", lambda parent, tokens, salt: b"one key for all")
    blocks = BlockManager(num_blocks=8, block_size=4)
    _run_prompt(blocks, _seq(0, [1, 2, 3, 4, 5]))
    other = _seq(1, [1, 2, 3, 5, 5])
    blocks.match_prefix(other)
    assert other.num_cached_tokens == 0 and other.block_table == []
    same = _seq(2, [1, 2, 3, 4, 6])
    blocks.match_prefix(same)
    assert same.num_cached_tokens == 4


def test_cache_salt_isolates_tenants() -> None:
    tokens = list(range(100, 133))  # two full blocks and one token
    blocks = BlockManager(num_blocks=16, block_size=16)
    _run_prompt(blocks, _seq(0, tokens, "tenant-a"))
    for seq_id, salt, cached in ((1, "tenant-b", 0), (2, None, 0), (3, "", 0),
                                 (4, "tenant-a\x00", 0), (5, "tenant-a", 32)):
        seq = _seq(seq_id, tokens + [1], salt)
        blocks.match_prefix(seq)
        assert seq.num_cached_tokens == cached, salt


def test_a_prefix_is_matched_block_by_block_up_to_the_first_difference() -> None:
    blocks = BlockManager(num_blocks=16, block_size=4)
    _run_prompt(blocks, _seq(0, list(range(13))))
    seq = _seq(1, list(range(8)) + [99] + list(range(9, 13)))  # third block differs
    blocks.match_prefix(seq)
    assert seq.num_cached_tokens == 8
    # a later block equal to a cached one does not match after a different parent
    moved = _seq(2, [99, 1, 2, 3] + list(range(4, 13)))
    blocks.match_prefix(moved)
    assert moved.num_cached_tokens == 0


def test_freed_blocks_stay_reusable_until_reallocated_oldest_first() -> None:
    blocks = BlockManager(num_blocks=4, block_size=4)
    first = _seq(0, list(range(9)))  # two full blocks + one token: three blocks
    _run_prompt(blocks, first)
    blocks.free_sequence(first)
    assert blocks.num_free_blocks == 4

    again = _seq(1, list(range(9)))
    blocks.match_prefix(again)
    assert again.num_cached_tokens == 8
    blocks.free_sequence(again)

    # a new prompt needing three blocks takes the never-used block, the old partial tail, then the
    # second full block (a sequence frees its tail first); the first block stays cached
    _run_prompt(blocks, _seq(2, list(range(50, 59))))
    third = _seq(3, list(range(9)))
    blocks.match_prefix(third)
    assert third.num_cached_tokens == 4
    assert blocks.blocks[third.block_table[0]].token_ids == (0, 1, 2, 3)
    evicted = [b for b in blocks.blocks if b.key is None]
    assert all(b.token_ids == () for b in evicted)
    assert len(blocks.cached) == sum(b.key is not None for b in blocks.blocks)


def test_no_prefix_caching_never_matches() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    _run_prompt(blocks, _seq(0, list(range(9))))
    seq = _seq(1, list(range(9)))
    blocks.match_prefix(seq)
    assert seq.num_cached_tokens == 0 and blocks.cached == {}


def _with_image(key: bytes, salt: str | None = None) -> Sequence:
    """A 40-token prompt whose tokens 4..35 are one image's placeholders (all the same id)."""
    tokens = [5, 6, 7, 8] + [99] * 32 + [9, 10, 11, 12]
    seq = Sequence(0, "r", 0, list(tokens), len(tokens), SamplingParams(max_tokens=4),
                   cache_salt=salt)
    seq.mm_items = (MultiModalItem("image", 4, 32, key, {}),)
    seq.key_prompt = media_key_tokens(tokens, seq.mm_items)
    return seq


def test_placeholder_blocks_are_keyed_by_the_image() -> None:
    """Identical placeholder tokens share KV only when the image (its content key) is the same."""
    red, blue = bytes(range(32)), bytes(range(1, 33))
    manager = BlockManager(num_blocks=16, block_size=16)
    first = _with_image(red)
    manager.allocate(first, len(first))
    first.num_computed_tokens = len(first)
    manager.commit_full_blocks(first, 0)
    same, other = _with_image(red), _with_image(blue)
    manager.match_prefix(same)
    manager.match_prefix(other)
    assert same.num_cached_tokens == 32 and same.block_table == first.block_table[:2]
    assert other.num_cached_tokens == 0
    words = media_key_tokens([0] * 8, (MultiModalItem("image", 0, 8, red, {}),))
    assert all(w < 0 for w in words) and len(set(words)) == 4 and words[:4] == words[4:]
