"""The host allocator keeps what a step freed: the next step's tensors reuse it instead of
faulting fresh pages in."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

STEPS = """
import resource, sys, torch
from kvbaton.engine.host_allocator import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
faults = []
for _ in range(5):  # a step's tensors: 16 of 12 MB, all freed at its end
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones(3 * 2**20) for _ in range(16)]
    del tensors
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[0], sum(faults[1:]))
"""


def step_faults(mode: str) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True, timeout=60
    )
    first, later = out.stdout.split()
    return int(first), int(later)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_later_steps_reuse_the_memory_the_first_one_faulted_in() -> None:
    pages = 16 * 12 * 2**20 // 4096
    first, later = step_faults("retain")
    assert first > pages // 2
    assert later < pages // 5  # over the 4 later steps together (the heap settles in one)
    # Without it, glibc gives it back to the kernel, for at least one later step (up to all 4).
    first, later = step_faults("default")
    assert later > pages // 2
