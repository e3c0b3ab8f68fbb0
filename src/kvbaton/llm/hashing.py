"""Block hashing, defined once for engine, mocker and router.

hash(block) = H(parent_hash, token ids, extra keys), with H = 64-bit BLAKE2b over a fixed byte
layout: the parent as 8 little-endian bytes (0 for the first block), the token ids as 4-byte
little-endian integers, then the extra keys (LoRA name, cache salt, ...) msgpack-encoded. The
result is the same on every process and machine. Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import msgspec

_PARENT = struct.Struct("<Q")


def block_extra_keys(
    lora_name: str | None = None, cache_salt: str | None = None
) -> tuple[Any, ...] | None:
    """The extra keys of a request's blocks: blocks of another LoRA or salt never match."""
    keys: tuple[Any, ...] = ()
    if lora_name:
        keys += ("lora", lora_name)
    if cache_salt:
        keys += ("salt", cache_salt)
    return keys or None


def hash_block(
    parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None = None
) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(_PARENT.pack(parent_hash or 0))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if extra_keys:
        h.update(msgspec.msgpack.encode(extra_keys))
    return int.from_bytes(h.digest(), "little")


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[Any, ...] | None = None,
    parent_hash: int | None = None,
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (a partial last block is left out)."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent_hash)
    return hashes
