from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", "llama-tied")


@pytest.fixture(scope="session")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture and shapes as `tiny_model`, other weights."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "other", "llama-tied", seed=1)
