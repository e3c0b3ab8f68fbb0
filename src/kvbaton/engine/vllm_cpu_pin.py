"""Undo the core pin vLLM's NIXL connector puts on a CPU worker's model thread (disaggregated
`--engine vllm` on a CPU).

vLLM 0.32's NIXL connector, made on the model runner's main thread, pins that thread to the last
core of each NUMA node (`sched_setaffinity`), for its KV loads. That thread is also the master
of the runner's OpenMP team, which vLLM bound to its cores before: on two cores the team's two
threads then share the last one. Timed by hand on the 2-core machine (SmolLM2, a prefill and a
decode worker, 8 tokens): decode 13.5 s with the pin, 0.94 s without; prefill 1.7 s, 0.15 s.

- With the connector, vLLM's automatic binding also reserves a core for the KV loads: on two
  cores it cannot, and binds the team to both, where an aggregated engine has one thread. A
  different team computes different bf16 sums, and greedy answers drift from the aggregated
  ones. So a disaggregated engine is bound as an aggregated one would be
  (`aggregated_binding`: every core this process may run on but the last).
- The master goes back to the first core of the team's binding: `VLLM_CPU_OMP_THREADS_BIND`'s
  first core where it names cores, else the lowest core this process may run on (where
  vLLM's automatic binding starts).
- Only vLLM's model runner processes (`VLLM::Worker`) among this process's descendants; Linux
  only (/proc).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

from kvbaton.engine.vllm_reaper import descendants

log = logging.getLogger(__name__)

MODEL_RUNNER = "VLLM::Worker"


def aggregated_binding() -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` as vLLM's automatic binding of an aggregated engine: the
    cores this process may run on but the last (one core: that one)."""
    cores = sorted(os.sched_getaffinity(0))
    return ",".join(map(str, cores[:-1] or cores))


def first_bound_core() -> int:
    """The first core of vLLM's OpenMP binding for this process's engine."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if (first := re.match(r"\d+", bind)) is not None:
        return int(first.group())
    return min(os.sched_getaffinity(0))


def unpin_model_threads() -> list[int]:
    """Give each vLLM model runner's main thread the first core of its OpenMP binding back;
    the runners' pids."""
    core = first_bound_core()
    runners = []
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError):  # gone meanwhile
            name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().strip()
            if name == MODEL_RUNNER:
                os.sched_setaffinity(pid, {core})  # its main thread (tid = pid)
                runners.append(pid)
    log.info("vLLM model runners %s: main thread back on core %d", runners, core)
    return runners
