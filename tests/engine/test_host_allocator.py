"""The host allocator keeps what a step freed: once the heap has settled, a step's tensors reuse
it instead of faulting fresh pages in.

It takes a step or two to settle here (glibc 2.36; `engine/host_allocator.py` says why): the
second step faults 1 to 4 of its 16 pieces afresh, sometimes the third one piece (60 runs)."""

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
for _ in range(8):  # a step's tensors: 16 of 12 MB, all freed at its end
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones(3 * 2**20) for _ in range(16)]
    del tensors
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[0], sum(faults[1:3]), sum(faults[3:]))
"""
PAGES = 16 * 12 * 2**20 // 4096  # a step's


def step_faults(mode: str) -> tuple[int, int, int]:
    """The first step's minor faults, the next two steps', the last five steps'."""
    out = subprocess.run(
        [sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True, timeout=60
    )
    first, settling, settled = out.stdout.split()
    return int(first), int(settling), int(settled)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_once_settled_a_step_faults_no_memory_in() -> None:
    first, settling, settled = step_faults("retain")
    assert first > PAGES // 2
    assert settling < PAGES // 2  # the pieces a hole exactly their size could not take
    assert settled < PAGES // 64  # nothing but the interpreter's own
    # Without it, glibc mmaps the first step's pieces and unmaps them when freed: the second
    # step faults all of its pieces in again.
    first, settling, settled = step_faults("default")
    assert settling > PAGES // 2
