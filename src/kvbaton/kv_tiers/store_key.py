"""The key of a KV store: blocks are shared only between engines whose KV is interchangeable.

- Two engines share a key only with the same model (its config and a fingerprint of its weight
  files), the same cache layout (dtype, block size, layers, heads) and the same format version.
  The cache salt needs no part: it is in every block's chained hash.
- The weights' fingerprint reads each weight file's size and its first and last MiB, not all of
  it: models that differ only inside the middle of every file would share a key.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

FORMAT_VERSION = 1
_EDGE = 2**20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def store_key(model_dir: Path, layout: str) -> bytes:
    """16 bytes naming what a stored block's KV depends on."""
    digest = hashlib.sha256(f"kvbaton-kv-store {FORMAT_VERSION} {layout}\n".encode())
    config = model_dir / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in sorted(p for p in model_dir.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)):
        size = path.stat().st_size
        digest.update(f"{path.name} {size}\n".encode())
        with path.open("rb") as f:
            digest.update(f.read(_EDGE))
            f.seek(max(0, size - _EDGE), os.SEEK_SET)
            digest.update(f.read(_EDGE))
    return digest.digest()[:16]
