"""`--engine vllm`'s pieces that need no vLLM: kvbaton's flags as vLLM's, the `--` pass-through,
and the reaper that ends a dead worker's engine processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from multiprocessing import shared_memory
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvbaton.cli.main import build_parser, split_passthrough
from kvbaton.cli.worker import check_engine_flags
from kvbaton.engine.vllm_cpu_pin import aggregated_binding, first_bound_core
from kvbaton.engine.vllm_engine import resumes_constraints
from kvbaton.engine.vllm_options import GIB, mapped_args
from kvbaton.engine.vllm_reaper import SHM, Reaper, descendants, mapped_segments, start_time
from tests.helpers import wait_until_sync

pytestmark = pytest.mark.unit


def test_flags_map_to_vllm_s_and_the_cpu_sizes_its_kv_cache() -> None:
    flags = {"dtype": "bfloat16", "max_model_len": 2048, "num_kv_blocks": 64, "device": "cpu"}
    argv = mapped_args("/m", flags, on_cpu=True)
    assert argv[:2] == ["--model", "/m"]
    pairs = dict(zip(argv[2::2], argv[3::2], strict=False))
    assert pairs["--dtype"] == "bfloat16"
    assert pairs["--max-model-len"] == "2048"
    assert pairs["--num-gpu-blocks-override"] == "64"
    assert pairs["--kv-cache-memory-bytes"] == str(GIB)  # explicit: 92% of a node fails
    assert "--enforce-eager" in argv
    # Constraints compiled as kvbaton's engine compiles them: llguidance, compact JSON.
    assert "config.backend guidance" in " ".join(argv)
    assert "config.disable_any_whitespace True" in " ".join(argv)
    half = mapped_args("/m", {"kv_cache_gib": 0.5}, on_cpu=False)
    assert half[half.index("--kv-cache-memory-bytes") + 1] == str(GIB // 2)
    assert "--enforce-eager" not in mapped_args("/m", {}, on_cpu=False)
    assert "--kv-cache-memory-bytes" not in mapped_args("/m", {}, on_cpu=False)  # GPU: vLLM's


def test_constraints_resume_where_vllm_schedules_synchronously() -> None:
    def args(async_scheduling: bool | None, speculative: object = None) -> SimpleNamespace:
        return SimpleNamespace(async_scheduling=async_scheduling, speculative_config=speculative)

    assert resumes_constraints(args(None), on_cpu=True)  # vLLM's CPU never schedules async
    assert resumes_constraints(args(False), on_cpu=False)  # --no-async-scheduling on a GPU
    assert not resumes_constraints(args(None), on_cpu=False)  # the GPU's default: async
    assert not resumes_constraints(args(None, {"method": "ngram"}), on_cpu=True)


def test_flags_vllm_has_no_use_for_are_refused() -> None:
    with pytest.raises(ValueError, match="--num-threads is not for --engine vllm"):
        mapped_args("/m", {"num_threads": 2}, on_cpu=True)


def test_arguments_after_the_double_dash_are_vllm_s() -> None:
    ours, theirs = split_passthrough(["serve", "--engine", "vllm", "--", "--max-num-seqs", "8"])
    assert ours == ["serve", "--engine", "vllm"]
    assert theirs == ["--max-num-seqs", "8"]
    assert split_passthrough(["generate", "--", "-x"]) == (["generate", "--", "-x"], [])


def test_vllm_workers_disaggregate_in_the_prefill_first_order_only() -> None:
    flags = ["serve", "--engine", "vllm", "--mode", "disagg", "--transfer-order", "decode-first"]
    args = build_parser().parse_args(flags)
    with pytest.raises(ValueError, match="prefill-first order only"):
        check_engine_flags(args)  # before vLLM loads a model for nothing


def test_the_reaper_ends_the_processes_once_its_pipe_closes(tmp_path: Path) -> None:
    """The reaper watches this process; a child started after it, and noted when told it
    started, ends once the pipe closes (as when the worker dies), and the directory it was
    given goes; one started before it (the test session's servers, here) is left alone."""
    before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    wait_until_sync(lambda: ticks_since_boot() > (start_time(before.pid) or 0), 5, "a tick")
    endpoints = tmp_path / "endpoints"
    (endpoints / "sub").mkdir(parents=True)
    reaper = Reaper.start(remove=(endpoints,))
    assert reaper.pid is not None
    wait_until_sync(lambda: ticks_since_boot() > (start_time(reaper.pid) or 0), 5, "a tick")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert sleeper.pid in descendants(os.getpid())
        reaper.started()
        assert sleeper.poll() is None
        reaper.close(10)
        assert sleeper.wait(10) == -signal.SIGTERM
        assert before.poll() is None
        assert not endpoints.exists()
    finally:
        for proc in (sleeper, before):
            proc.kill()
            proc.wait()


MAKE_SEGMENTS = """
from multiprocessing import resource_tracker, shared_memory
import time
made = [shared_memory.SharedMemory(create=True, size=4096) for _ in range(2)]
for segment in made:  # as vLLM does: its own unlink runs only in a normal end
    resource_tracker.unregister(segment._name, "shared_memory")
print(*(segment.name for segment in made), flush=True)
time.sleep(60)
"""


def test_the_reaper_unlinks_the_shared_memory_its_processes_left() -> None:
    """A noted process that dies leaves its segments; the reaper unlinks those no process maps
    any more (one this process still maps stays), and leaves alone a segment no noted process
    mapped."""
    unrelated = shared_memory.SharedMemory(create=True, size=4096)
    reaper = Reaper.start()
    assert reaper.pid is not None
    wait_until_sync(lambda: ticks_since_boot() > (start_time(reaper.pid) or 0), 5, "a tick")
    maker = subprocess.Popen(
        [sys.executable, "-c", MAKE_SEGMENTS], stdout=subprocess.PIPE, text=True
    )
    assert maker.stdout is not None
    left, shared = maker.stdout.readline().split()
    kept = shared_memory.SharedMemory(shared)
    try:
        assert {left, shared} <= mapped_segments(maker.pid)
        reaper.started()
        reaper.close(10)
        assert maker.wait(10) == -signal.SIGTERM
        assert not (SHM / left).exists()
        assert (SHM / shared).exists()
        assert (SHM / unrelated.name).exists()
    finally:
        maker.kill()
        maker.wait()
        (SHM / left).unlink(missing_ok=True)
        for segment in (kept, unrelated):
            segment.close()
            segment.unlink()


def ticks_since_boot() -> int:
    """Now, in the clock ticks of /proc/PID/stat's start times."""
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return int(uptime * os.sysconf("SC_CLK_TCK"))


@pytest.mark.parametrize(("bind", "core"), [("4-7|8-11", 4), ("2,3", 2), ("auto", None)])
def test_the_model_thread_goes_back_to_the_first_core_of_its_binding(
    bind: str, core: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    assert first_bound_core() == (core if core is not None else min(os.sched_getaffinity(0)))


def test_a_disaggregated_engine_is_bound_as_an_aggregated_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every core but the last (kept for vLLM's KV loads); one core: that one."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 1, 2})
    assert aggregated_binding() == "1,2"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert aggregated_binding() == "5"


def test_cpu_cores_are_for_vllm_workers() -> None:
    args = build_parser().parse_args(["worker", "--engine", "torch", "--cpu-cores", "0"])
    with pytest.raises(ValueError, match="--cpu-cores is for --engine vllm"):
        check_engine_flags(args)
