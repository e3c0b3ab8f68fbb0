"""The model-card key layout that workers write and frontends read."""

import msgspec
import pytest

from kvbaton.llm.model_cards import model_card_key, parse_model_card_key
from kvbaton.protocols.llm import ModelCard
from kvbaton.workers.llm_worker import ROLES

pytestmark = pytest.mark.unit


def test_keys_round_trip_even_with_slashes_in_the_name() -> None:
    for name in ("smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        key = model_card_key("ns", name, 0xBEEF)
        assert key == f"/models/ns/{name}/beef"
        assert parse_model_card_key("ns", key) == (name, 0xBEEF)


def test_other_keys_are_not_cards() -> None:
    for key in ("/models/other/m/beef", "/models/ns/m/not-hex", "/models/ns/beef", "/x"):
        assert parse_model_card_key("ns", key) is None


def test_roles_are_the_workers_words_and_agg_is_the_default() -> None:
    def card(**role: str) -> ModelCard:
        return ModelCard(
            name="m", endpoint="e", instance_id=1, context_length=8, kv_block_size=4, **role
        )

    assert card().role == "agg" and ROLES == ("agg", "prefill", "decode")
    for role in ROLES:
        wire = msgspec.json.encode(card(role=role))
        assert msgspec.json.decode(wire, type=ModelCard).role == role
    assert b"role" not in msgspec.json.encode(card(role="agg"))  # an agg worker's card
