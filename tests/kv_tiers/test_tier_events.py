"""The tiers' KV events, in the engine's one stream: blocks kept in host memory are stored
(tier host) and removed when its LRU drops them or the cache is cleared; blocks written to disk
are stored (tier disk, naming the store) once written, removed when rejected; a dump lists
both; event ids stay one sequence with no gap."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbaton.protocols.kv import DEVICE, DISK, HOST, BlockRemoved, BlockStored, KvEvent
from tests.kv_tiers.tier_helpers import (
    block_hashes,
    evict_all,
    greedy,
    prompt,
    tiered_engine,
    tiers_of,
)

pytestmark = pytest.mark.unit
PROMPT = prompt(0)


def of_tier(events: list[KvEvent], kind: type, tier: str) -> set[int]:
    return {h for e in events if isinstance(e, kind) and e.tier == tier for h in e.block_hashes}


def test_host_and_disk_events_and_dump(tiny_model: Path, tmp_path: Path) -> None:
    events: list[KvEvent] = []
    eng = tiered_engine(tiny_model, host_bytes=2**26, disk_dir=tmp_path, on_event=events.append)
    greedy(eng, PROMPT)
    evict_all(eng)
    tiers = tiers_of(eng)
    tiers.close()  # every write done
    assert [e.event_id for e in events] == list(range(len(events)))
    prefix = set(block_hashes(PROMPT)[:4])
    assert prefix <= of_tier(events, BlockStored, HOST)
    assert prefix <= of_tier(events, BlockStored, DISK)
    disk_events = [e for e in events if isinstance(e, BlockStored) and e.tier == DISK]
    assert tiers.disk is not None and {e.store for e in disk_events} == {tiers.disk.store}
    dump = eng.kv_dump()
    assert dump.last_event_id == events[-1].event_id
    assert prefix <= set(dump.host_block_hashes) and prefix <= set(dump.store_block_hashes)
    assert dump.store == tiers.disk.store
    assert set(dump.block_hashes) == of_tier(events, BlockStored, DEVICE) - of_tier(
        events, BlockRemoved, DEVICE
    )
    eng.clear_kv_blocks()
    assert set(dump.host_block_hashes) <= of_tier(events, BlockRemoved, HOST)
    assert eng.kv_dump().host_block_hashes == []


def test_host_lru_drops_are_removals(tiny_model: Path) -> None:
    block = tiers_of(tiered_engine(tiny_model, host_bytes=1)).view.block_bytes
    events: list[KvEvent] = []
    eng = tiered_engine(tiny_model, host_bytes=3 * block, on_event=events.append)
    greedy(eng, PROMPT)
    evict_all(eng)
    kept = of_tier(events, BlockStored, HOST) - of_tier(events, BlockRemoved, HOST)
    assert len(kept) == 3 and set(eng.kv_dump().host_block_hashes) == kept
