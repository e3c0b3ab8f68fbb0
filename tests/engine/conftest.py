"""The engine's tests run on tiny random models of each supported architecture."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import ARCHITECTURES, build_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(root / arch, arch) for arch in ARCHITECTURES}
