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
import asyncio
import random
import time
from pathlib import Path

from kvbaton.engine.decode_package import BUILD_WAIT_S
from serving import (
    STARTUP_S,
    Frontend,
    log,
    run_benchmark,
    scratch_dir,
    serve_run,
    start_serve,
    stop,
    wait_for_workers,
    worker_load,
)
from vllm_front import Comparison, System, arguments, kv_cache_flags, prompts, run

PROGRESS_S = 30.0
PROBE_S = 2.0  # between the requests that wait for the compiled decode (a build needs the CPU)


async def start_kvbaton(args: argparse.Namespace, model_dir: Path) -> System:
    """`kvbaton serve` with its defaults (but for where it registers: a directory of its own),
    once its single decodes run compiled."""
    discovery = f"file://{scratch_dir('kvbaton-bench-')}"
    # serve's default; bench/serving.py's environment sets "none" for the other benchmarks
    serve = start_serve(discovery, "--model", str(model_dir), env={"KVBATON_COMPILE": "auto"})
    try:
        model = await wait_for_workers(serve.url, 0, 1, STARTUP_S)
        await wait_until_compiled(serve, model, discovery, args.prompt_tokens)
    except BaseException:
        stop(serve.proc)  # type: ignore[arg-type]
        raise
    return System(serve.proc, serve.url, model)


async def wait_until_compiled(
    serve: Frontend, model: str, discovery: str, prompt_tokens: int
) -> None:
    """Send a short request every `PROBE_S` until the worker's single decodes run compiled
    (their package loaded: seconds after the start, or minutes where the worker builds it
    first); raises where they failed or took over `BUILD_WAIT_S`."""
    rng = random.Random(0)
    start = said = time.monotonic()
    while (state := (await worker_load(discovery)).compiled_decode) != "on":
        waited = time.monotonic() - start
        if state != "loading" or waited > BUILD_WAIT_S:
            last = "\n".join(serve.lines[-10:])
            raise RuntimeError(
                f"kvbaton's single decodes are {state} after {waited:.0f} s; serve said:\n{last}"
            )
        if time.monotonic() - said >= PROGRESS_S:
            log(f"waiting {waited:.0f} s for kvbaton's compiled single decode (a first build)")
            said = time.monotonic()
        await serve_run(serve.url, model, prompts(rng, 1, prompt_tokens), 1, 4)
        await asyncio.sleep(PROBE_S)


VS_VLLM = Comparison("vs_vllm", "serve, its own engine", 1.0, 1.0, start_kvbaton, kv_cache_flags)


async def run_vs_vllm(args: argparse.Namespace) -> int:
    return await run(args, VS_VLLM)


if __name__ == "__main__":
    run_benchmark(run_vs_vllm, arguments(__doc__).parse_args())
