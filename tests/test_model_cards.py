"""The model-card key layout that workers write and frontends read."""

import pytest

from kvbaton.llm.model_cards import model_card_key, parse_model_card_key

pytestmark = pytest.mark.unit


def test_keys_round_trip_even_with_slashes_in_the_name() -> None:
    for name in ("smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        key = model_card_key("ns", name, 0xBEEF)
        assert key == f"/models/ns/{name}/beef"
        assert parse_model_card_key("ns", key) == (name, 0xBEEF)


def test_other_keys_are_not_cards() -> None:
    for key in ("/models/other/m/beef", "/models/ns/m/not-hex", "/models/ns/beef", "/x"):
        assert parse_model_card_key("ns", key) is None
