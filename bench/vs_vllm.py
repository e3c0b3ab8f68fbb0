"""kvbaton's own engine beside vLLM (issue 32): `kvbaton serve` and `vllm serve`, each with its
defaults, the same model and streamed workload at concurrency 1 and 16, in one run.

    scripts/vllm_env.sh && kvbaton pull smollm2
    .venv-vllm/bin/python bench/vs_vllm.py [--repeats 2] [--requests 3]

- kvbaton: `kvbaton serve --model M`, nothing else (its built-in engine, one worker, a KV cache
  of 1 GiB), measured once its single decodes run compiled, as its default (`--compile auto`)
  runs them once their package is on the machine: the first run on a machine waits minutes
  for the worker to build it (progress is logged); later ones find it.
- vLLM: `vllm serve M` with only what it needs to start here: a KV cache of `--kv-cache-gib`
  (1 GiB; on a CPU its default, 92% of a NUMA node's memory, fails). Its other defaults stay,
  compiled model included (no `--enforce-eager`).
- The workload, the figures (output tok/s, TTFT p50, CPU per request of every process) and the
  alternating order of the systems are bench/vllm_front.py's; `--max-model-len` is not used.
- Target (issue 32): kvbaton's output tok/s at least 1.0x vLLM's at both concurrencies, and its
  TTFT p50 at most 1.0x.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from kvbaton.engine.decode_package import BUILD_WAIT_S, cxx_compiler_missing
from serving import (
    STARTUP_S,
    log,
    run_benchmark,
    scratch_dir,
    serve_run,
    start_serve,
    wait_for_workers,
    worker_load,
)
from vllm_front import Comparison, System, arguments, kv_cache_flags, prompts, run

PROGRESS_S = 30.0


async def start_kvbaton(args: argparse.Namespace, model_dir: Path) -> System:
    """`kvbaton serve` with its defaults (but for where it registers: a directory of its own),
    once its single decodes run compiled."""
    if missing := cxx_compiler_missing():
        raise RuntimeError(f"kvbaton serve's default would decode eagerly here: {missing}")
    discovery = f"file://{scratch_dir('kvbaton-bench-')}"
    # serve's default; bench/serving.py's environment sets "none" for the other benchmarks
    serve = start_serve(discovery, "--model", str(model_dir), env={"KVBATON_COMPILE": "auto"})
    model = await wait_for_workers(serve.url, 0, 1, STARTUP_S)
    await wait_until_compiled(serve.url, model, discovery)
    return System(serve.proc, serve.url, model)


async def wait_until_compiled(url: str, model: str, discovery: str) -> None:
    """Send short requests, one at a time, until the worker has run a single decode compiled
    (its package loaded: seconds after the start, or minutes where it builds it first)."""
    rng = random.Random(0)
    start = said = time.monotonic()
    while (await worker_load(discovery)).compiled_decode_steps == 0:
        waited = time.monotonic() - start
        if waited > BUILD_WAIT_S:
            raise RuntimeError(
                f"kvbaton's single decodes did not run compiled within {BUILD_WAIT_S:.0f} s"
            )
        if time.monotonic() - said >= PROGRESS_S:
            log(f"waiting {waited:.0f} s for kvbaton's compiled single decode (a first build)")
            said = time.monotonic()
        await serve_run(url, model, prompts(rng, 1, 16), 1, 4)


VS_VLLM = Comparison("vs_vllm", "serve, its own engine", 1.0, 1.0, start_kvbaton, kv_cache_flags)


async def run_vs_vllm(args: argparse.Namespace) -> int:
    return await run(args, VS_VLLM)


if __name__ == "__main__":
    run_benchmark(run_vs_vllm, arguments(__doc__).parse_args())
