"""KV tiers for the mocker: the real stores (`kv_tiers`), with a stand-in of `STAMP_BYTES` per
block, and loads that take the time the modeled KV would (`MockerTiming.load_seconds`).

- A tier holds as many blocks as its size holds of the modeled KV (the model's layers, KV heads
  and head size, bfloat16), so hit rates are those of the real engine with the same sizes.
- Mocker blocks never match the built-in engine's: their layout (`mocker:...`) is in the store
  key.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from kvbaton.engine.connector import EmitEvent, KvCacheView, KvLoad
from kvbaton.kv_tiers import KvTiers, TierSettings
from kvbaton.kv_tiers.block_file import HEADER_BYTES
from kvbaton.kv_tiers.disk import DiskTier
from kvbaton.kv_tiers.host import HostTier
from kvbaton.kv_tiers.store_key import store_key
from kvbaton.mocker.timing import MockerTiming

STAMP_BYTES = 8
MODELED_DTYPE_BYTES = 2  # bfloat16


def modeled_block_bytes(model_dir: Path, block_size: int) -> int:
    """The bytes of a block of the model's KV, all layers, in bfloat16."""
    c = json.loads((model_dir / "config.json").read_text())
    heads = c.get("num_key_value_heads", c["num_attention_heads"])
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return int(c["num_hidden_layers"] * 2 * block_size * heads * head_dim * MODELED_DTYPE_BYTES)


class MockerTiers(KvTiers):
    def __init__(
        self,
        view: KvCacheView,
        host: HostTier | None,
        disk: DiskTier | None,
        emit: EmitEvent | None,
        timing: MockerTiming,
        block_bytes: int,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(view, host, disk, emit)
        self.timing = timing
        self.block_bytes = block_bytes  # modeled
        self._sleep = sleep

    def load(self, load: KvLoad) -> list[int]:
        in_memory = sum(1 for h in load.block_hashes if (self.host is not None and h in self.host))
        tokens = super().load(load)
        on_disk = len(load.block_hashes) - in_memory
        self._sleep(
            self.timing.load_seconds(in_memory * self.block_bytes, on_disk * self.block_bytes)
        )
        return tokens


def mocker_tiers(
    settings: TierSettings,
    model_dir: Path,
    block_size: int,
    timing: MockerTiming,
    sleep: Callable[[float], None] = time.sleep,
) -> Callable[[KvCacheView, EmitEvent], MockerTiers]:
    """The tiers of a mocker engine (its own view of `STAMP_BYTES` a block)."""
    modeled = modeled_block_bytes(model_dir, block_size)

    def build(engine_view: KvCacheView, emit: EmitEvent) -> MockerTiers:
        view = KvCacheView(
            f"mocker:{block_size}",
            engine_view.num_blocks,
            STAMP_BYTES,
            memoryview(bytearray(engine_view.num_blocks * STAMP_BYTES)),
        )
        host = None
        if settings.host_bytes > 0:
            host = HostTier(settings.host_bytes // modeled * STAMP_BYTES)
        disk = None
        if settings.disk_dir is not None:
            capacity = settings.disk_bytes // modeled * (HEADER_BYTES + STAMP_BYTES)
            key = store_key(model_dir, view.layout)
            disk = DiskTier(settings.disk_dir, key, STAMP_BYTES, capacity)
        return MockerTiers(view, host, disk, emit, timing, modeled, sleep)

    return build
