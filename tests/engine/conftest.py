"""The engine's tests run on tiny random models of each supported architecture.

They run on the CPU unless KVBATON_TEST_DEVICE names another torch device (e.g. "cuda"): then
the engine and the HF reference it is compared with both run there, in the same dtype."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.tiny_models import ARCHITECTURES, build_tiny_model

TEST_DEVICE = os.environ.get("KVBATON_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(root / arch, arch) for arch in ARCHITECTURES}
