"""The memory a compiled decode's package may take (`decode_package.available_memory`): the
machine's available memory, or less where a cgroup v2 limit of the process's cgroup, or of one
above it, leaves less (its droppable page cache counted as free)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbaton.engine.decode_package import available_memory

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
