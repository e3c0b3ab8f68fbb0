"""The mocker needs a model directory only for its config and tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import build_chat_model


@pytest.fixture(scope="session")
def mocker_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat")
