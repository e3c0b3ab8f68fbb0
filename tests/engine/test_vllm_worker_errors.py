"""A vLLM worker that cannot start ends with a clear message, not a traceback (issue 30): vLLM
missing (where it is not installed), options vLLM rejects and a model it cannot load (where it
is: scripts/vllm_env.sh)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvbaton.engine.vllm_engine import INSTALL_HINT
from tests.helpers import NEEDS_VLLM, VLLM_INSTALLED
from tests.tiny_models import build_chat_model

START_S = 300  # vLLM's import alone takes seconds on a loaded 2-core machine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat")


def worker(tmp_path: Path, model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`kvbaton worker --engine vllm` run to its end."""
    command = [sys.executable, "-m", "kvbaton", "worker", "--engine", "vllm"]
    command += ["--model", str(model), "--discovery", f"file://{tmp_path / 'discovery'}"]
    return subprocess.run(
        [*command, *extra], capture_output=True, text=True, timeout=START_S, cwd=tmp_path
    )


def assert_ended_with(done: subprocess.CompletedProcess[str], message: str) -> None:
    """Exit code 2 (a usage error) and kvbaton's error line, which holds `message`."""
    assert done.returncode == 2, done.stderr[-2000:]
    _, found, error = done.stderr.partition("kvbaton: error: ")
    assert found and message in error, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]


@pytest.mark.integration
@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed here")
def test_without_vllm_the_worker_says_what_to_install(tmp_path: Path, model_dir: Path) -> None:
    assert_ended_with(worker(tmp_path, model_dir), INSTALL_HINT)


@pytest.mark.vllm
@pytest.mark.integration
@NEEDS_VLLM
def test_options_vllm_rejects_end_the_worker(tmp_path: Path, model_dir: Path) -> None:
    done = worker(tmp_path, model_dir, "--", "--no-such-option")
    assert_ended_with(done, "vLLM rejected the arguments ['--no-such-option']")


@pytest.mark.vllm
@pytest.mark.integration
@NEEDS_VLLM
def test_a_model_vllm_cannot_load_ends_the_worker(tmp_path: Path, model_dir: Path) -> None:
    unknown = tmp_path / "unknown-model"
    shutil.copytree(model_dir, unknown)
    config = json.loads((unknown / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (unknown / "config.json").write_text(json.dumps(config))
    assert_ended_with(worker(tmp_path, unknown), "NoSuchModelForCausalLM")
