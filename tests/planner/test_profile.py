"""`kvbaton profile` against mocker workers: the curves it measures follow the mocker's timing
model (plus a bounded overhead), it measures a running worker through --endpoint, bad flags and
a worker that cannot start fail clearly, and Ctrl-C stops the worker it started."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbaton.cli.main import main
from kvbaton.mocker import MockerTiming
from kvbaton.planner.types import Profile
from tests.conftest import WorkerFactory
from tests.helpers import clean_env
from tests.tiny_models import build_chat_model

pytestmark = pytest.mark.integration

SPEEDUP = 10.0
PREFILL = (0.0, 0.1, 5.0)  # ms = 0.1 * t + 5: a slope the test sees clearly at SPEEDUP 10
OVERHEAD_MS = 10.0  # request plane, engine loop; ~2 ms measured on 2 idle cores
MOCKER = ["--engine", "mocker", "--speedup-ratio", str(SPEEDUP), "--max-model-len", "4096"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat")


def profile(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    return subprocess.run(
        [sys.executable, "-m", "kvbaton", "profile", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def written(result: subprocess.CompletedProcess[str], output: Path) -> Profile:
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == str(output)  # the path comes last
    return Profile.from_json(output.read_bytes())


def test_prefill_follows_the_mockers_timing_model(model: Path, tmp_path: Path) -> None:
    output = tmp_path / "f.json"
    result = profile(
        "--role", "prefill", *MOCKER, "--model", str(model), "--output", str(output),
        "--mocker-prefill", ",".join(map(str, PREFILL)),
        "--prefill-tokens", "64,512,1024", "--repeats", "2",
    )  # fmt: skip
    got = written(result, output)
    assert (got.engine, got.model, got.decode) == ("mocker", model.name, [])
    assert [p.x for p in got.prefill] == [64, 512, 1024]
    assert "prefill 1024 tokens:" in result.stderr  # one progress line per point
    timing = MockerTiming(prefill=PREFILL, speedup_ratio=SPEEDUP)
    for point in got.prefill:
        expected = timing.step_seconds(int(point.x), 0, 0.0) * 1000
        assert expected * 0.95 <= point.ms <= expected + OVERHEAD_MS, (point, expected)
    ms = [p.ms for p in got.prefill]
    assert ms == sorted(ms), ms


def test_decode_follows_the_mockers_kv_usage(model: Path, tmp_path: Path) -> None:
    """With a small cache the mocker's step time grows with the KV in use, so with the batch."""
    output = tmp_path / "f.json"
    block_size, blocks, context, tokens = 16, 512, 256, 64
    result = profile(
        "--role", "decode", *MOCKER, "--model", str(model), "--output", str(output),
        "--block-size", str(block_size), "--num-kv-blocks", str(blocks),
        "--decode-batches", "1,4,16", "--decode-context", str(context),
        "--decode-tokens", str(tokens),
    )  # fmt: skip
    got = written(result, output)
    assert (got.prefill, got.decode_context) == ([], context)
    assert [p.x for p in got.decode] == [1, 4, 16]
    timing = MockerTiming(speedup_ratio=SPEEDUP)
    for point in got.decode:
        low = point.x * (context // block_size) / blocks  # KV in use while all decode
        high = point.x * (math.ceil((context + tokens) / block_size) + 1) / blocks
        expected_low = timing.step_seconds(0, 1, low) * 1000
        expected_high = timing.step_seconds(0, 1, high) * 1000
        assert expected_low * 0.9 <= point.ms <= expected_high + OVERHEAD_MS, point
    assert got.decode[-1].ms >= got.decode[0].ms * 0.8


def test_a_running_worker_is_measured_and_both_roles_share_a_file(
    model: Path, tmp_path: Path, spawn_worker: WorkerFactory, discovery_url: str
) -> None:
    spawn_worker("--model", str(model), *MOCKER[2:], engine="mocker", namespace="ns")
    output = tmp_path / "f.json"
    running = ["--discovery", discovery_url, "--endpoint", "ns.backend.generate"]
    common = [*running, "--engine", "mocker", "--output", str(output)]
    result = profile("--role", "prefill", *common, "--prefill-tokens", "16,128", "--repeats", "1")
    assert "profile: worker" not in result.stderr  # none started
    written(result, output)
    result = profile(
        "--role", "decode", *common, "--decode-batches", "1,2", "--decode-context", "32"
    )
    got = written(result, output)
    assert [p.x for p in got.prefill] == [16, 128]  # kept from the first run
    assert [p.x for p in got.decode] == [1, 2] and got.decode_context == 32
    assert all(p.ms > 0 for p in [*got.prefill, *got.decode])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--role", "train"], "invalid choice: 'train'"),
        (["--role", "prefill", "--prefill-tokens", "512,64"], "strictly ascending"),
        (["--role", "prefill", "--prefill-tokens", ","], "--prefill-tokens needs at least one"),
        (["--role", "decode", "--decode-batches", "0,4"], "must be positive"),
        (["--role", "decode", "--decode-batches", "1,x"], "expected integers"),
        (["--role", "decode", "--decode-context", "-5"], "--decode-context must be at least 1"),
        (["--role", "prefill", "--repeats", "0"], "--repeats must be at least 1"),
        (["--role", "prefill", "--speedup-ratio", "2"], "--speedup-ratio is for --engine mocker"),
        (["--role", "prefill", "--discovery", "mem://x"], "add --endpoint"),
    ],
)
def test_bad_flags_fail_clearly(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["profile", *flags, "--output", str(tmp_path / "f.json")])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "f.json").exists()


def test_a_worker_that_cannot_start_is_reported_with_its_log(tmp_path: Path) -> None:
    result = profile(
        "--role", "prefill", *MOCKER, "--model", str(tmp_path / "missing"),
        "--output", str(tmp_path / "f.json"),
    )  # fmt: skip
    assert result.returncode == 1
    assert "the worker exited" in result.stderr and "no model at" in result.stderr
    assert not (tmp_path / "f.json").exists()


def test_ctrl_c_stops_the_worker_it_started(model: Path, tmp_path: Path) -> None:
    err = tmp_path / "stderr"
    with open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvbaton", "profile", "--role", "prefill",
             "--engine", "mocker", "--model", str(model), "--max-model-len", "8192",
             "--prefill-tokens", "8000", "--repeats", "1000", "--output", str(tmp_path / "f")],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )  # fmt: skip
    worker = 0
    try:
        deadline = time.monotonic() + 30
        while not worker and time.monotonic() < deadline and proc.poll() is None:
            for line in err.read_text().splitlines():
                if line.startswith("profile: worker "):
                    worker = int(line.split()[2])
            time.sleep(0.1)
        assert worker, err.read_text()
        time.sleep(3)  # measuring: 1000 prefills of 0.17 s each
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130, err.read_text()
        with pytest.raises(ProcessLookupError):
            os.kill(worker, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if worker:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
