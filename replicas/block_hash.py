"""The key of a full block of prompt tokens, shared by the KV cache and the router.

A key is a 16-byte BLAKE2b digest over the cache salt, the parent block's key and the block's token
ids, each part length-prefixed so no two different inputs encode alike (salt None, "" and one that
contains a separator all differ). Chaining through the parent makes a key stand for the whole
prefix. Python's `hash()` of a token tuple, used before, has collisions that can be built by hand
(the tuple hash is invertible per item), and a hit was not checked against the tokens: a crafted
prompt could read another tenant's KV (vLLM's CVE-2025-25183). The cache also compares a hit's
token ids (replicas/kv_cache.py), so even a digest collision cannot share KV."""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

BlockKey = bytes
_NO_SALT = b"\x00"


def _salt_bytes(salt: str | None) -> bytes:
    if salt is None:
        return _NO_SALT
    raw = salt.encode("utf-8", "surrogatepass")
    return b"\x01" + struct.pack("<I", len(raw)) + raw


def block_key(parent: BlockKey | None, tokens: Sequence[int], salt: str | None) -> BlockKey:
    h = hashlib.blake2b(digest_size=16)
    h.update(_salt_bytes(salt))
    h.update(parent if parent is not None else b"\x00" * 16)
    h.update(struct.pack("<I", len(tokens)))
    h.update(array("q", tokens).tobytes())
    return h.digest()


def prefix_keys(token_ids: Sequence[int], block_size: int, salt: str | None,
                max_blocks: int | None = None) -> list[BlockKey]:
    """The chained keys of the full blocks at the start of `token_ids`."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    keys: list[BlockKey] = []
    parent: BlockKey | None = None
    for i in range(n):
        parent = block_key(parent, token_ids[i * block_size:(i + 1) * block_size], salt)
        keys.append(parent)
    return keys
