"""An engine with KV tiers below its pool, on a tiny model: a prefix evicted from the pool is
loaded back from host memory or disk with the greedy tokens of a recompute; the disk tier
outlives its engine, serves another engine on the same directory, rejects damaged files, and
never matches another model's blocks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvbaton.llm.hashing import reusable_blocks
from tests.kv_tiers.tier_helpers import (
    BLOCK_SIZE,
    block_hashes,
    evict_all,
    greedy,
    prompt,
    tier_stats,
    tiered_engine,
    tiers_of,
)

pytestmark = pytest.mark.unit

PROMPT = prompt(0)
BLOCKS = reusable_blocks(len(PROMPT), BLOCK_SIZE)


@pytest.fixture(scope="module")
def expected(tiny_model: Path) -> list[int]:
    """The prompt's greedy tokens, computed with no tier."""
    return greedy(tiered_engine(tiny_model), PROMPT)


def offload_to_disk(model: Path, disk: Path) -> None:
    """Serve the prompt on an engine of its own, evict it to `disk`, and close the engine."""
    eng = tiered_engine(model, disk_dir=disk)
    greedy(eng, PROMPT)
    evict_all(eng)
    tiers_of(eng).close()
    assert tier_stats(eng).written_blocks >= BLOCKS


def test_host_tier_serves_an_evicted_prefix(tiny_model: Path, expected: list[int]) -> None:
    eng = tiered_engine(tiny_model, host_bytes=2**26)
    assert greedy(eng, PROMPT) == expected
    evict_all(eng)
    assert not set(block_hashes(PROMPT)) & set(eng.blocks.cached)  # the pool lost it
    assert greedy(eng, PROMPT) == expected
    stats = tier_stats(eng)
    assert (stats.hit_blocks_host, stats.hit_blocks_disk, stats.loads) == (BLOCKS, 0, 1)
    assert stats.host_blocks > 0 and stats.host_bytes <= stats.host_capacity_bytes


def test_disk_tier_serves_an_evicted_prefix(
    tiny_model: Path, expected: list[int], tmp_path: Path
) -> None:
    offload_to_disk(tiny_model, tmp_path)
    eng = tiered_engine(tiny_model, disk_dir=tmp_path)  # a restarted worker, the same disk
    assert greedy(eng, PROMPT) == expected
    stats = tier_stats(eng)
    assert (stats.hit_blocks_disk, stats.loads, stats.load_failures) == (BLOCKS, 1, 0)


def test_a_second_engine_serves_the_first_ones_offload(
    tiny_model: Path, expected: list[int], tmp_path: Path
) -> None:
    first = tiered_engine(tiny_model, disk_dir=tmp_path)
    second = tiered_engine(tiny_model, disk_dir=tmp_path)
    greedy(first, PROMPT)
    evict_all(first)
    tiers_of(first).close()  # its writes are done
    assert greedy(second, PROMPT) == expected
    assert tier_stats(second).hit_blocks_disk == BLOCKS


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _flip], ids=["truncated", "bit-flipped"])
def test_a_damaged_block_file_is_a_miss(
    tiny_model: Path, expected: list[int], tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    offload_to_disk(tiny_model, tmp_path)
    files = sorted(tmp_path.glob("*/*/*.kvb"))
    eng = tiered_engine(tiny_model, disk_dir=tmp_path)
    disk = tiers_of(eng).disk
    assert disk is not None
    second_block = disk.path(block_hashes(PROMPT)[1])
    assert second_block in files
    damage(second_block)
    assert greedy(eng, PROMPT) == expected
    stats = tier_stats(eng)
    assert (stats.loads, stats.load_failures, stats.rejected_blocks) == (0, 1, 1)
    assert not second_block.exists()


def test_another_model_never_matches(tiny_model: Path, other_model: Path, tmp_path: Path) -> None:
    offload_to_disk(tiny_model, tmp_path)
    own = greedy(tiered_engine(other_model), PROMPT)
    eng = tiered_engine(other_model, disk_dir=tmp_path)
    assert greedy(eng, PROMPT) == own
    assert tier_stats(eng).loads == 0
