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
from pathlib import Path

from kvbaton.cli.profile import settle_compiled_decode
from serving import (
    STARTUP_S,
    log,
    run_benchmark,
    scratch_dir,
    start_serve,
    stop,
    wait_for_workers,
    worker_load,
)
from vllm_front import Comparison, System, arguments, kv_cache_flags, run


async def start_kvbaton(args: argparse.Namespace, model_dir: Path) -> System:
    """`kvbaton serve` with its defaults (but for where it registers: a directory of its own),
    once its single decodes run compiled (their package loaded: seconds after the start, or
    minutes where its worker builds it first)."""
    discovery = f"file://{scratch_dir('kvbaton-bench-')}"
    # serve's default; bench/serving.py's environment sets "none" for the other benchmarks
    serve = start_serve(discovery, "--model", str(model_dir), env={"KVBATON_COMPILE": "auto"})

    def alive() -> None:
        if serve.proc.poll() is not None:
            raise RuntimeError(f"kvbaton serve exited ({serve.proc.returncode})")

    try:
        model = await wait_for_workers(serve.url, 0, 1, STARTUP_S)
        state = await settle_compiled_decode(lambda: worker_load(discovery), alive, log)
        if state != "on":
            last = "\n".join(serve.lines[-10:])
            raise RuntimeError(f"kvbaton's single decodes are {state}; serve said:\n{last}")
    except BaseException:
        stop(serve.proc)  # type: ignore[arg-type]
        raise
    return System(serve.proc, serve.url, model)


VS_VLLM = Comparison("vs_vllm", "serve, its own engine", 1.0, 1.0, start_kvbaton, kv_cache_flags)


async def run_vs_vllm(args: argparse.Namespace) -> int:
    return await run(args, VS_VLLM)


if __name__ == "__main__":
    run_benchmark(run_vs_vllm, arguments(__doc__).parse_args())
