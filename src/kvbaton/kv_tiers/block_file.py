"""A stored block's bytes: a header, then the block's KV (docs/architecture.md, "KV tiers").

Layout, little-endian: magic `KVBTBLK1`, the store key (16 bytes), the block hash (u64), the
KV's length (u64), a checksum (the first 16 bytes of SHA-256 over all of the above and the KV),
then the KV.
- `decode` accepts only a whole block of the expected store, hash and length whose checksum
  matches: a truncated, bit-flipped or foreign file is a miss, never wrong KV.
"""

from __future__ import annotations

import hashlib
import struct

MAGIC = b"KVBTBLK1"
_FIELDS = struct.Struct("<8s16sQQ")
CHECKSUM_BYTES = 16
HEADER_BYTES = _FIELDS.size + CHECKSUM_BYTES


def _checksum(fields: bytes, kv: bytes | memoryview) -> bytes:
    digest = hashlib.sha256(fields)
    digest.update(kv)
    return digest.digest()[:CHECKSUM_BYTES]


def encode_header(store_key: bytes, block_hash: int, kv: bytes | memoryview) -> bytes:
    """The header to write before `kv`."""
    fields = _FIELDS.pack(MAGIC, store_key, block_hash, len(kv))
    return fields + _checksum(fields, kv)


def decode(data: bytes, store_key: bytes, block_hash: int, kv_bytes: int) -> memoryview | None:
    """The KV of a stored block, or None unless it is whole and the one expected."""
    if len(data) != HEADER_BYTES + kv_bytes:
        return None
    fields = data[: _FIELDS.size]
    magic, key, stored_hash, length = _FIELDS.unpack(fields)
    if (magic, key, stored_hash, length) != (MAGIC, store_key, block_hash, kv_bytes):
        return None
    kv = memoryview(data)[HEADER_BYTES:]
    if _checksum(fields, kv) != data[_FIELDS.size : HEADER_BYTES]:
        return None
    return kv
