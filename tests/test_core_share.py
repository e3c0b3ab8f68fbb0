"""serve's share of the cores for each worker (kvbaton.cli.core_share)."""

import argparse
import dataclasses
import os

import pytest

from kvbaton.cli.core_share import CoreShare, core_share, vllm_worker_cores
from kvbaton.cli.planner import vllm_core_slots

pytestmark = pytest.mark.unit


def test_one_torch_worker_keeps_torchs_default_of_every_core() -> None:
    assert core_share("torch", workers=1, cores=2, num_threads=None) == CoreShare()
    assert core_share("torch", workers=1, cores=64, num_threads=None).worker_threads is None


@pytest.mark.parametrize(
    ("workers", "cores", "threads"),
    [(2, 2, 1), (2, 8, 4), (3, 8, 2), (4, 2, 1), (16, 2, 1)],
)
def test_torch_workers_split_the_cores_at_least_one_thread_each(
    workers: int, cores: int, threads: int
) -> None:
    assert core_share("torch", workers, cores, None) == CoreShare(worker_threads=threads)


@pytest.mark.parametrize("workers", [1, 2, 8])
def test_an_explicit_num_threads_is_kept(workers: int) -> None:
    assert core_share("torch", workers, 2, 3) == CoreShare(worker_threads=3)
    assert core_share("mocker", workers, 2, 3) == CoreShare(worker_threads=3)


@pytest.mark.parametrize("engine", ["mocker", "fixed", "echo"])
def test_engines_without_torch_threads_get_nothing(engine: str) -> None:
    assert core_share(engine, 4, 2, None) == CoreShare()


@pytest.mark.parametrize(
    ("workers", "cores", "num_threads", "named"),
    [(0, 2, None, "workers"), (1, 0, None, "cores"), (1, 2, 0, "--num-threads")],
)
def test_nonsense_is_refused_naming_what(
    workers: int, cores: int, num_threads: int | None, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        core_share("torch", workers, cores, num_threads)


def test_the_share_is_frozen() -> None:
    share = core_share("torch", 2, 2, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        share.worker_threads = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("workers", "cores", "shares"),
    [
        (1, [0, 1], None),  # vLLM's own binding
        (2, [1, 0], ["0", "1"]),
        (2, [0, 1, 2, 3], ["0,1", "2,3"]),
        (3, [4, 5, 6, 7], ["4", "5", "6,7"]),
        (3, [0, 1], ["0", "1", "0"]),  # more workers than cores: in turn
    ],
)
def test_vllm_workers_get_a_slice_of_the_cores_each(
    workers: int, cores: list[int], shares: list[str] | None
) -> None:
    assert vllm_worker_cores(workers, cores) == shares


PLANNER = argparse.Namespace(max_workers=None, max_prefill=8, max_decode=8)


@pytest.mark.parametrize(
    ("flags", "environ", "bound"),
    [
        ("--engine vllm --model M", {}, False),
        ("--engine=vllm -- --max-num-seqs 8", {}, False),
        ("--engine vllm --cpu-cores 0-1", {}, True),  # the user's binding
        ("--engine vllm", {"VLLM_CPU_OMP_THREADS_BIND": "0"}, True),
        ("--engine torch", {}, True),  # torch threads are not bound
        ("--model M", {}, True),
        ("--engine echo -- --engine vllm", {}, True),  # after --: vLLM's own
    ],
)
def test_the_planner_splits_the_cores_among_its_vllm_workers(
    flags: str, environ: dict[str, str], bound: bool
) -> None:
    slots = vllm_core_slots(PLANNER, flags.split(), environ)
    cores = list(os.sched_getaffinity(0))
    assert slots == ([] if bound else vllm_worker_cores(16, cores))


def test_the_planners_worker_budget_sets_the_slots() -> None:
    budget = argparse.Namespace(max_workers=2, max_prefill=8, max_decode=8)
    cores = list(os.sched_getaffinity(0))
    assert vllm_core_slots(budget, ["--engine", "vllm"], {}) == vllm_worker_cores(2, cores)
