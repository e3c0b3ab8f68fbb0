"""Block hashing, defined once for engine, mocker and router.

hash(block) = H(parent_hash, token ids, extra keys), with H = 64-bit BLAKE2b over a fixed byte
layout: the parent as 8 little-endian bytes (0 for the first block), the token ids as 4-byte
little-endian integers, then the extra keys (LoRA name, cache salt, ...) msgpack-encoded. The
result is the same on every process and machine. Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

_PARENT = struct.Struct("<Q")
_TOKEN = "I" if array("I").itemsize == 4 else "L"  # 4-byte unsigned


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as 4-byte little-endian integers (OverflowError outside [0, 2**32))."""
    packed = array(_TOKEN, token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def block_extra_keys(cache_salt: str | None = None) -> tuple[Any, ...] | None:
    """The extra keys of a request's blocks: blocks of another salt never match."""
    return ("salt", cache_salt) if cache_salt else None


def reusable_blocks(prompt_tokens: int, block_size: int) -> int:
    """How many full blocks of a prompt a prefix cache can give: at least its last token is
    computed, to sample from (kvbaton's engine and vLLM alike)."""
    return max(0, prompt_tokens - 1) // block_size


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[Any, ...] | None = None,
    parent_hash: int | None = None,
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (a partial last block is left out)."""
    data = _token_bytes(token_ids[: len(token_ids) // block_size * block_size])
    extra = msgspec.msgpack.encode(extra_keys) if extra_keys else b""
    step = 4 * block_size
    hashes: list[int] = []
    blake2b, pack, from_bytes = hashlib.blake2b, _PARENT.pack, int.from_bytes  # the hot loop
    parent = parent_hash or 0
    for start in range(0, len(data), step):
        h = blake2b(pack(parent), digest_size=8)
        h.update(data[start : start + step] + extra)
        parent = from_bytes(h.digest(), "little")
        hashes.append(parent)
    return hashes
