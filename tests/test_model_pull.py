"""Two pulls of one model at once (two `kvbaton pull`, two test processes): the second waits for
the first, then finds the model pulled; it neither downloads it again nor replaces the directory
the first one made while others read it."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbaton.llm import model_files
from kvbaton.llm.model_files import pull
from tests.helpers import wait_until_sync

HOLD = """
import fcntl, sys
with open(sys.argv[1], "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    print("held", flush=True)
    sys.stdin.readline()
"""

pytestmark = pytest.mark.unit


@pytest.fixture
def other_pull(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[subprocess.Popen[str]]:
    """Another process in the middle of pulling smollm2 into `tmp_path` (it holds the lock); it
    ends when its stdin closes."""
    monkeypatch.setenv("KVBATON_MODELS_DIR", str(tmp_path))
    monkeypatch.setattr(model_files, "_download_and_convert", _no_download)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / ".smollm2.lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    yield proc
    proc.kill()
    proc.wait(10)


def _no_download(*args: object) -> None:
    raise AssertionError("pulled again")


def test_a_second_pull_waits_for_the_first_then_finds_the_model(
    other_pull: subprocess.Popen[str], tmp_path: Path
) -> None:
    lines: list[str] = []
    got: list[Path] = []
    second = threading.Thread(target=lambda: got.append(pull("smollm2", progress=lines.append)))
    second.start()
    wait_until_sync(lambda: bool(lines), 10, "the second pull saying it waits")
    assert lines == ["another process is pulling smollm2: waiting for it"] and second.is_alive()

    (tmp_path / "smollm2").mkdir()  # the first pull's model appears whole, then it ends
    (tmp_path / "smollm2" / "config.json").write_text("{}")
    assert other_pull.stdin is not None
    other_pull.stdin.close()
    second.join(10)
    assert got == [tmp_path / "smollm2"]
    assert lines[1:] == ["smollm2 is already pulled"]


def test_a_pull_that_waits_too_long_says_who_holds_it(
    other_pull: subprocess.Popen[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_files, "PULL_WAIT_S", 0.2)
    with pytest.raises(
        TimeoutError, match=r"pulling smollm2 for over 0 s \(it holds .*\.smollm2\.lock\)"
    ):
        pull("smollm2", progress=lambda line: None)


def test_a_pulled_model_is_found_without_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing is written beside a pulled model: its directory may be read-only (a volume)."""
    monkeypatch.setenv("KVBATON_MODELS_DIR", str(tmp_path))
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "config.json").write_text("{}")
    lines: list[str] = []
    assert pull("smollm2", progress=lines.append) == tmp_path / "smollm2"
    assert lines == ["smollm2 is already pulled"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2"]
