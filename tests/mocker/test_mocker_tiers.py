"""The mocker's KV tiers: the real stores with stand-in bytes, sized in the modeled KV's bytes,
and a load that takes the modeled KV's bytes over the tier's bandwidth; a second mocker on the
same disk directory loads what the first offloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbaton.engine import LLMEngine
from kvbaton.kv_tiers import TierSettings
from kvbaton.llm.hashing import reusable_blocks
from kvbaton.mocker import MockerRunner, MockerTiming
from kvbaton.mocker.runner import mocker_config
from kvbaton.mocker.tiers import MockerTiers, mocker_tiers, modeled_block_bytes
from tests.kv_tiers.tier_helpers import evict_all, greedy, prompt, tier_stats

pytestmark = pytest.mark.unit
BLOCK_SIZE = 4
TIMING = MockerTiming()
PROMPT = prompt(0, 40)
BLOCKS = reusable_blocks(len(PROMPT), BLOCK_SIZE)


def mocker(model: Path, settings: TierSettings, sleeps: list[float]) -> LLMEngine:
    runner = MockerRunner(model, TIMING)
    tiers = mocker_tiers(settings, model, BLOCK_SIZE, TIMING, sleeps.append)
    config = mocker_config(model=str(model), num_kv_blocks=24, block_size=BLOCK_SIZE)
    engine = LLMEngine(config, None, runner, kv_tier=tiers)
    runner.blocks = engine.blocks
    return engine


def test_tiers_are_sized_and_priced_in_the_modeled_kv(mocker_model: Path, tmp_path: Path) -> None:
    block = modeled_block_bytes(mocker_model, BLOCK_SIZE)
    settings = TierSettings(host_bytes=100 * block, disk_dir=tmp_path, disk_bytes=1000 * block)
    sleeps: list[float] = []
    eng = mocker(mocker_model, settings, sleeps)
    tiers = eng.tier
    assert isinstance(tiers, MockerTiers) and tiers.host is not None
    assert tier_stats(eng).host_capacity_bytes == 100 * 8  # 100 blocks of 8 stand-in bytes
    first = greedy(eng, PROMPT)
    evict_all(eng)
    assert greedy(eng, PROMPT) == first
    assert tier_stats(eng).hit_blocks_host == BLOCKS
    assert sleeps == [TIMING.load_seconds(BLOCKS * block, 0)]


def test_a_second_mocker_loads_from_the_shared_disk(mocker_model: Path, tmp_path: Path) -> None:
    settings = TierSettings(disk_dir=tmp_path, disk_bytes=2**30)
    first = mocker(mocker_model, settings, [])
    answer = greedy(first, PROMPT)
    evict_all(first)
    assert first.tier is not None
    first.tier.close()
    sleeps: list[float] = []
    second = mocker(mocker_model, settings, sleeps)
    assert greedy(second, PROMPT) == answer
    assert tier_stats(second).hit_blocks_disk == BLOCKS
    block = modeled_block_bytes(mocker_model, BLOCK_SIZE)
    assert sleeps == [TIMING.load_seconds(0, BLOCKS * block)]


def test_a_load_costs_bytes_over_bandwidth_over_the_speedup() -> None:
    timing = MockerTiming(host_gbps=10, disk_gbps=2, speedup_ratio=2)
    assert timing.load_seconds(10**9, 10**9) == pytest.approx((0.1 + 0.5) / 2)
    with pytest.raises(ValueError, match="gbps"):
        MockerTiming(disk_gbps=0)
