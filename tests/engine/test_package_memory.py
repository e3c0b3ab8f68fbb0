"""The memory a compiled decode's package may take (`decode_package.available_memory`): the
machine's available memory, or less where a cgroup v2 limit of the process's cgroup, or of one
above it, leaves less (its droppable page cache counted as free); processes check it and load
a package in turns (`load_fitting`)."""

from __future__ import annotations

import errno
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvbaton.engine import decode_package
from kvbaton.engine.decode_package import (
    LOAD_MARGIN_BYTES,
    BuildFailed,
    LoadFailed,
    available_memory,
    load_fitting,
)

pytestmark = pytest.mark.unit

GIB = 1 << 30


def machine(root: Path, available_kib: int, own: str) -> tuple[Path, Path]:
    """A procfs with `available_kib` of memory available and a process in cgroup `own`."""
    proc, cgroups = root / "proc", root / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(f"0::{own}\n")
    (cgroups / own.lstrip("/")).mkdir(parents=True)
    return proc, cgroups


def limit(cgroup: Path, limit: str, used: int, inactive_file: int) -> None:
    (cgroup / "memory.max").write_text(f"{limit}\n")
    (cgroup / "memory.current").write_text(f"{used}\n")
    (cgroup / "memory.stat").write_text(f"anon {used}\ninactive_file {inactive_file}\n")


def test_without_a_limit_it_is_the_machines_available_memory(tmp_path: Path) -> None:
    proc, cgroups = machine(tmp_path, 8 * 1024 * 1024, "/")
    assert available_memory(proc, cgroups) == 8 * GIB
    limit(cgroups, "max", GIB, 0)
    assert available_memory(proc, cgroups) == 8 * GIB


def test_a_containers_limit_leaves_less_counting_its_page_cache_free(tmp_path: Path) -> None:
    proc, cgroups = machine(tmp_path, 8 * 1024 * 1024, "/pod/worker")
    limit(cgroups / "pod" / "worker", str(2 * GIB), 3 * GIB // 2, GIB // 4)
    assert available_memory(proc, cgroups) == 3 * GIB // 4
    limit(cgroups / "pod", str(GIB), GIB - GIB // 8, 0)  # the cgroup above leaves less
    assert available_memory(proc, cgroups) == GIB // 8


def test_nothing_known_is_none(tmp_path: Path) -> None:
    assert available_memory(tmp_path / "proc", tmp_path / "cgroup") is None


def test_loads_of_a_package_check_the_memory_in_turns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two loads started together (two workers, say) where the memory holds one: the second
    checks once the first took its memory, and is refused; without turns both would fit."""
    package = tmp_path / "model.so"
    package.write_bytes(bytes(4096))
    room = [LOAD_MARGIN_BYTES + 4096]  # for one load
    checks: list[int] = []
    second_check = threading.Event()

    def available() -> int:
        checks.append(room[0])
        if len(checks) == 2:
            second_check.set()
        return room[0]

    def load(path: Path) -> str:
        second_check.wait(1.0)  # without turns, the other load checks meanwhile
        room[0] -= path.stat().st_size
        return "loaded"

    monkeypatch.setattr(decode_package, "available_memory", available)
    together = threading.Barrier(2)

    def start() -> str:
        together.wait()
        return load_fitting(package, load)

    with ThreadPoolExecutor(2) as pool:  # (each opens the lock: they take turns as processes)
        futures = [pool.submit(start) for _ in range(2)]
    outcomes = [f.result() if f.exception() is None else type(f.exception()) for f in futures]
    assert sorted(map(str, outcomes)) == sorted(["loaded", str(decode_package.TooLargeToLoad)])
    assert checks == [LOAD_MARGIN_BYTES + 4096, LOAD_MARGIN_BYTES]


def test_a_load_that_fails_says_to_remove_the_package(tmp_path: Path) -> None:
    package = tmp_path / "model.so"
    package.write_bytes(bytes(16))

    def load(path: Path) -> None:
        raise OSError("not an archive")

    with pytest.raises(LoadFailed, match=re.escape("did not load (not an archive); remove it")):
        load_fitting(package, load)


def test_a_package_in_a_directory_it_may_not_write_loads_without_turns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "model.so"
    package.write_bytes(bytes(16))

    def read_only(*args: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(decode_package, "one_at_a_time", read_only)
    assert load_fitting(package, lambda path: path.name) == "model.so"


def test_no_load_starts_once_stopped(tmp_path: Path) -> None:
    package = tmp_path / "model.so"
    package.write_bytes(bytes(16))
    stopped = threading.Event()
    stopped.set()  # (while it waited for its turn, say)
    loads: list[Path] = []
    with pytest.raises(BuildFailed, match="stopped before loading"):
        load_fitting(package, loads.append, stopped)
    assert not loads
