"""A cache's host mirror (a GPU's, or one forced with `host_mirror`): staging copies exactly the
blocks and layers asked for, in runs of consecutive blocks; on CUDA the mirror is pinned
(KVBATON_TEST_DEVICE=cuda, scripts/cuda_check.sh) and unpinned when its pool closes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbaton.engine import EngineConfig
from kvbaton.engine.model_runner import ModelRunner, block_runs
from kvbaton.kv_transfer import KvPool
from tests.engine.conftest import TEST_DEVICE

pytestmark = pytest.mark.unit
ON_CUDA = TEST_DEVICE.startswith("cuda")


def test_block_runs_are_the_runs_of_consecutive_ids_in_order() -> None:
    assert block_runs([3, 4, 5, 9, 2, 3, 7]) == [(3, 3), (9, 1), (2, 2), (7, 1)]
    assert block_runs([]) == []


def test_staging_copies_the_blocks_and_layers_asked_for(tiny_models: dict[str, Path]) -> None:
    model_dir = tiny_models["llama-tied"]
    config = EngineConfig(
        model=str(model_dir), dtype="float32", device=TEST_DEVICE, block_size=8, num_kv_blocks=16
    )
    pool = KvPool(shared=False, pin=ON_CUDA)
    runner = ModelRunner.create(model_dir, config, pool.allocate, host_mirror=True)
    try:
        assert (pool.pinned is not None) == ON_CUDA
        cache, mirror = runner.cache, runner.mirror
        assert cache is not None and mirror is not None
        assert mirror.is_pinned() == ON_CUDA
        generator = torch.Generator().manual_seed(0)
        cache.copy_(torch.randn(cache.shape, generator=generator))
        want = torch.zeros_like(mirror)
        on_host = cache.cpu()
        runner.stage_out([2, 3, 4, 9, 7])
        want[[2, 3, 4, 9, 7]] = on_host[[2, 3, 4, 9, 7]]
        runner.stage_out([11, 12], (1, 2))
        want[[11, 12], 1:2] = on_host[[11, 12], 1:2]
        assert torch.equal(mirror, want)

        mirror.copy_(torch.randn(mirror.shape, generator=generator))
        runner.stage_in([0, 1, 5])
        on_host[[0, 1, 5]] = mirror[[0, 1, 5]]
        runner.stage_in([13, 15], (0, 2))
        on_host[[13, 15], 0:2] = mirror[[13, 15], 0:2]
        assert torch.equal(cache.cpu(), on_host)
    finally:
        del runner
        pool.close()
    assert pool.pinned is None
