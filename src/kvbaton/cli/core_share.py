"""Each worker's share of the cores under `kvbaton serve` (issue 27): the torch threads serve
gives every worker, chosen from measurements.

The policy: with one worker, no `--num-threads` (torch's default: every core this process may
run on); with N workers, cores // N threads each (at least one); an explicit `--num-threads`
is kept; nothing for engines without torch threads, nothing reserved for the frontend, no
environment and no CPU sets. It needs every torch parallel region of a worker to run on one
thread (see below): a worker that loads its model on one thread and steps on another makes
this policy half as fast as the offline engine.

Measured on the 2-core development machine with `python bench/serve_vs_offline.py
--serve-args "" --serve-args "--num-threads 1" ...` (SmolLM2-135M, 64 tokens per request,
closed loop at concurrency 1 and 16; serve / offline `kvbaton.engine.LLM` in the same run,
output tokens/s):

- The frontend costs little: 0.01-0.03 cores at 16 streams (the benchmark's httpx client
  0.02-0.05). Reserving a core for it is not what serve lacked.
- What it lacked was GNU OpenMP's spinning: a worker that loads its model on
  `asyncio.to_thread`'s thread and steps on its engine thread has two OpenMP thread pools,
  3 OpenMP threads on 2 cores, and libgomp then spins only 100 times before a thread sleeps
  (`gomp_throttled_spin_count_var`), so every parallel region pays a futex wake-up. serve with
  its old defaults: 0.40-0.75x at concurrency 1, 0.48-0.90x at 16; `OMP_WAIT_POLICY=PASSIVE`
  the same (0.49-0.50x at 1). `GOMP_SPINCOUNT` cannot lift the throttled spin.
- `--num-threads 1` (no OpenMP teams at all): 0.77-1.07x at 1 but 0.70-0.84x at 16: one core
  left for the frontend is a core the decode at batch 16 needs.
- One OpenMP master per worker (the model loaded on a thread that ends before the engine
  steps), 2 threads: 0.90-1.17x at 1, 0.82-0.84x at 16, the best of all at both; with
  `OMP_PROC_BIND=true` no better (0.91-0.96x, 0.77-0.84x), with `GOMP_SPINCOUNT=30000` worse
  at 1 (0.98-1.00x).

More than 2 cores was not measured: for N workers the rule is today's (cores // N), which
keeps one OpenMP team per core.

vLLM's workers (`--engine vllm`) bind their OpenMP threads themselves: each process binds to
the cores it may run on but one, the same ones in every worker, so that two workers on two
cores both computed on core 0. serve gives each of several vLLM workers its own slice of the
cores instead (`vllm_worker_cores`, passed as `--cpu-cores`). Timed by hand on the 2-core
machine (`serve --engine vllm --workers 2`, 4 requests of 64 tokens at once): 7.2 s on core 0
together, 3.2 s with one core each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TORCH_ENGINE = "torch"  # the one engine that runs torch threads


@dataclass(frozen=True)
class CoreShare:
    """What serve gives each worker: `worker_threads` is its `--num-threads` (None: pass none,
    the engine picks)."""

    worker_threads: int | None = None


def core_share(engine: str, workers: int, cores: int, num_threads: int | None) -> CoreShare:
    """The share of each of `workers` worker processes (prefill and decode ones together) of
    `engine` on `cores` cores (those this process may run on: `len(os.sched_getaffinity(0))`),
    `num_threads` being the user's `--num-threads` (None when not given)."""
    if workers < 1 or cores < 1:
        raise ValueError(f"workers and cores must be at least 1, not {workers} and {cores}")
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"--num-threads must be at least 1, not {num_threads}")
        return CoreShare(worker_threads=num_threads)
    if engine != TORCH_ENGINE or workers == 1:
        return CoreShare()
    return CoreShare(worker_threads=max(1, cores // workers))


def vllm_worker_cores(workers: int, cores: Sequence[int]) -> list[str] | None:
    """Each of `workers` vLLM workers' cores (a CPU list, as vLLM's VLLM_CPU_OMP_THREADS_BIND),
    contiguous slices of `cores` (those this process may run on), at least one each, in
    turn when there are more workers than cores; None for one worker (vLLM's own binding)."""
    if workers < 1 or not cores:
        raise ValueError(f"workers and cores must be at least 1, not {workers} and {len(cores)}")
    if workers == 1:
        return None
    ordered = sorted(cores)
    n = len(ordered)
    if workers >= n:
        return [str(ordered[i % n]) for i in range(workers)]
    slices = [ordered[i * n // workers : (i + 1) * n // workers] for i in range(workers)]
    return [",".join(map(str, part)) for part in slices]
