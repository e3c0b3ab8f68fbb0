"""The `decode_side` and `prefill_side` fixtures: a `DecodeSide` and `PrefillSide` on
stand-ins (fakes.py), whose transfer timeout (the wait for a claim) is 0.5 s; closed at the
end. `serving_engine`: an `AsyncEngine` on a tiny random model, the mocker's and the built-in
one's (a test using it runs on each), with 32 blocks of 8 tokens and `max_num_seqs` 2; shut
down at the end."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvbaton.disagg.decode_side import DecodeSide
from kvbaton.disagg.prefill_side import PrefillSide
from kvbaton.engine import AsyncEngine, EngineConfig
from kvbaton.mocker import MockerTiming, create_mocker_engine
from tests.engine.conftest import TEST_DEVICE
from tests.tiny_models import build_chat_model
from tests.workers.fakes import make_decode_side, make_prefill_side


@pytest.fixture
async def decode_side() -> AsyncIterator[DecodeSide]:
    made = make_decode_side(timeout_s=0.5)
    yield made
    await made.close()


@pytest.fixture
async def prefill_side() -> AsyncIterator[PrefillSide]:
    made = make_prefill_side(timeout_s=0.5)
    yield made
    await made.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat")


@pytest.fixture(params=["mocker", "torch"])
async def serving_engine(
    request: pytest.FixtureRequest, tiny_model: Path
) -> AsyncIterator[AsyncEngine]:
    config = EngineConfig(
        model=str(tiny_model),
        dtype="float32",
        device=TEST_DEVICE,
        block_size=8,
        num_kv_blocks=32,
        max_num_seqs=2,
    )
    if request.param == "mocker":
        engine = await create_mocker_engine(config, MockerTiming(speedup_ratio=1000))
    else:
        engine = await AsyncEngine.create(config)
    yield engine
    await engine.shutdown()
