"""Soak benchmark: `kvbaton serve` with mocker workers kept at 70% of its capacity for a long
while. Does any process's memory grow, does latency drift; with `--chaos`, does it lose requests
while a random worker is killed every minute?

    python bench/soak.py [--minutes 20] [--load 0.7] [--workers 2] [--speedup-ratio 0.2]
                         [--chaos [--chaos-every-s 60]]

1. Capacity, measured first: the deployment is driven closed-loop (`--concurrency` clients, each
   sending its next request when the previous one ends) for `--calibrate-s`; capacity = the
   requests completed per second. (Load shedding is off: the clients queue, none is refused.)
2. The soak: Poisson arrivals (seeded) at `--load` x capacity for `--minutes`. Each request is a
   streaming `/v1/completions` of `--isl` random prompt token ids (distinct: no prefix hits) and
   `--osl` output tokens. Every `--window-s`: the p50/p99 TTFT and end-to-end latency of the
   requests that ended in the window, the failures, and the resident memory (VmRSS) of serve's
   frontend, each worker (the process in its slot then) and serve itself.
3. `--chaos`: every `--chaos-every-s` of the soak, a worker chosen at random (seeded) is killed
   with SIGKILL; serve starts a new one in its slot, and its requests migrate.

Printed: one row per window; then the drift (p99 of the last window over the first, which is the
baseline measured in the same run) and each process's memory growth from the end of the first
window to the end of the run, with its slope per hour. The deployment: `kvbaton serve --engine
mocker` on the tokenizer and config of `--model` (smollm2 by default, pulled if missing),
aggregated, timings divided by `--speedup-ratio` (below 1: slower) and at most `--max-num-seqs`
requests running at once, so that the workers, not the 2 cores, saturate first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

import headline
from kvbaton.llm.model_files import resolve_model
from kvbaton.runtime.serve_state import read_states
from serving import (
    STARTUP_S,
    log,
    pct,
    run_benchmark,
    sse_chunks,
    start_serve,
    stop,
    wait_for_workers,
)

NAMESPACE = "benchsoak"


@dataclass
class Done:
    ended: float  # monotonic
    ttft: float
    latency: float
    ok: bool


def rss_mib(pid: int) -> float:
    """NaN for a process gone (a worker killed, not yet started again)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return float("nan")
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Deployment:
    """serve's processes: its own, and the one in each of its slots now."""

    serve_pid: int
    discovery: str

    def pids(self) -> dict[str, int]:
        (state,) = read_states(self.discovery)
        slots = {s["name"]: int(s["pid"]) for s in state["slots"] if s["pid"]}
        return {**slots, "serve": self.serve_pid}


async def chaos(args: argparse.Namespace, deployment: Deployment, kills: list[float]) -> None:
    """Every `--chaos-every-s`, SIGKILL a worker of serve's chosen at random (seeded)."""
    rng = random.Random(args.seed + 1)
    while True:
        await asyncio.sleep(args.chaos_every_s)
        workers = {n: p for n, p in deployment.pids().items() if n.startswith("worker-")}
        name = rng.choice(sorted(workers))
        os.kill(workers[name], signal.SIGKILL)
        kills.append(time.monotonic())
        log(f"  chaos: killed {name} (pid {workers[name]})")


async def one(http: httpx.AsyncClient, model: str, prompt: list[int], osl: int) -> Done:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": osl,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.monotonic()
    ttft = float("nan")
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Done(time.monotonic(), ttft, time.monotonic() - started, False)
            async for _, _chunk in sse_chunks(response):
                if ttft != ttft:  # nan: the first chunk
                    ttft = time.monotonic() - started
    except (httpx.HTTPError, RuntimeError):
        return Done(time.monotonic(), ttft, time.monotonic() - started, False)
    return Done(time.monotonic(), ttft, time.monotonic() - started, True)


def prompts(args: argparse.Namespace, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(16, vocab) for _ in range(args.isl)]


async def calibrate(
    http: httpx.AsyncClient, args: argparse.Namespace, model: str, vocab: int
) -> float:
    """Requests/s completed with `--concurrency` clients in a closed loop."""
    rng = random.Random(1)
    end = time.monotonic() + args.calibrate_s
    done = 0

    async def client() -> None:
        nonlocal done
        while time.monotonic() < end:
            if (await one(http, model, prompts(args, vocab, rng), args.osl)).ok:
                done += 1

    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return done / (time.monotonic() - started)


async def soak(
    http: httpx.AsyncClient,
    args: argparse.Namespace,
    model: str,
    vocab: int,
    rate: float,
    deployment: Deployment,
) -> list[dict[str, float]]:
    rng = random.Random(args.seed)
    kills: list[float] = []
    chaotic = asyncio.create_task(chaos(args, deployment, kills)) if args.chaos else None
    finished: list[Done] = []
    tasks: set[asyncio.Task[None]] = set()
    windows: list[dict[str, float]] = []
    start = time.monotonic()
    end = start + args.minutes * 60
    next_window = start + args.window_s

    async def send(prompt: list[int]) -> None:
        finished.append(await one(http, model, prompt, args.osl))

    at = start
    while True:
        at += rng.expovariate(rate)
        while next_window <= min(at, end):  # close the windows that end before this arrival
            await asyncio.sleep(max(0.0, next_window - time.monotonic()))
            pids = deployment.pids()
            w = window(finished, kills, next_window - args.window_s, next_window, pids)
            windows.append(w)
            log(
                f"  {len(windows) * args.window_s / 60:5.1f} min: {w['requests']:.0f} requests, "
                f"{w['failed']:.0f} failed, {w['kills']:.0f} kills, TTFT p99 {w['ttft_p99']:.0f} "
                f"ms, latency p99 {w['lat_p99']:.0f} ms, RSS "
                + ", ".join(f"{n} {w[n]:.0f}" for n in pids)
                + " MiB"
            )
            next_window += args.window_s
        if at >= end:
            break
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        task = asyncio.create_task(send(prompts(args, vocab, rng)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if chaotic is not None:
        chaotic.cancel()
    await asyncio.gather(*tasks)
    return windows


def window(
    finished: list[Done], kills: list[float], start: float, end: float, pids: dict[str, int]
) -> dict[str, float]:
    these = [d for d in finished if start <= d.ended < end]
    ok = [d for d in these if d.ok]
    row = {
        "requests": float(len(these)),
        "failed": float(len(these) - len(ok)),
        "kills": float(sum(start <= k < end for k in kills)),
        "ttft_p50": pct([d.ttft * 1e3 for d in ok], 0.5),
        "ttft_p99": pct([d.ttft * 1e3 for d in ok], 0.99),
        "lat_p50": pct([d.latency * 1e3 for d in ok], 0.5),
        "lat_p99": pct([d.latency * 1e3 for d in ok], 0.99),
    }
    row.update({name: rss_mib(pid) for name, pid in pids.items()})
    return row


def report(
    args: argparse.Namespace,
    capacity: float,
    rate: float,
    windows: list[dict[str, float]],
    names: list[str],
) -> None:
    chaos = f"; a worker killed every {args.chaos_every_s:g} s" if args.chaos else ""
    print(
        f"\nkvbaton serve, mocker workers x{args.workers} (speedup {args.speedup_ratio:g}), "
        f"{args.isl}-token "
        f"prompts, {args.osl} output tokens. Capacity (closed loop, {args.concurrency} clients, "
        f"{args.calibrate_s:g}s): {capacity:.2f} req/s; soak at {args.load:.0%}: "
        f"{rate:.2f} req/s for {args.minutes:g} min (seed {args.seed}){chaos}. Times in ms, "
        "RSS in MiB.\n"
    )
    print(
        "| minute | requests | failed | TTFT p50 | TTFT p99 | latency p50 | latency p99 | "
        + " | ".join(names)
        + " | kills |"
    )
    print("|---:" * (8 + len(names)) + "|")
    for i, w in enumerate(windows):
        print(
            f"| {(i + 1) * args.window_s / 60:.1f} | {w['requests']:.0f} | {w['failed']:.0f} "
            f"| {w['ttft_p50']:.0f} | {w['ttft_p99']:.0f} | {w['lat_p50']:.0f} "
            f"| {w['lat_p99']:.0f} | "
            + " | ".join(f"{w.get(n, float('nan')):.0f}" for n in names)
            + f" | {w['kills']:.0f} |"
        )
    first, last = windows[0], windows[-1]
    hours = (len(windows) - 1) * args.window_s / 3600
    ttft_drift = last["ttft_p99"] / first["ttft_p99"]
    print(
        f"\ndrift (last window over the first): TTFT p99 x{ttft_drift:.2f}, "
        f"latency p99 x{last['lat_p99'] / first['lat_p99']:.2f}; failed "
        f"{sum(w['failed'] for w in windows):.0f} of {sum(w['requests'] for w in windows):.0f}"
        f"; workers killed {sum(w['kills'] for w in windows):.0f}"
    )
    growth = ", ".join(
        f"{n} {last[n] - first[n]:+.1f} MiB ({(last[n] - first[n]) / hours:+.1f} MiB/h)"
        if hours
        else f"{n} {last[n] - first[n]:+.1f} MiB"
        for n in names
    )
    print(f"memory growth after the first window: {growth}")
    print()
    report_headlines(args, windows, names)


JUDGED_AFTER_S = 600.0  # the RSS slope is judged after the first 10 minutes (warm-up)


def report_headlines(
    args: argparse.Namespace, windows: list[dict[str, float]], names: list[str]
) -> None:
    """Requests failed (target 0); the steepest RSS slope after the first 10 minutes (target
    under 5 MiB/h; not judged on a shorter run); the latency p99 of the last window against the
    first's (no target)."""
    sent = sum(w["requests"] for w in windows)
    failed = sum(w["failed"] for w in windows)
    kills = sum(w["kills"] for w in windows)
    headline.report(
        "soak",
        f"{failed:.0f} of {sent:.0f} requests failed",
        f"{kills:.0f} workers killed" if args.chaos else "no worker killed",
        ratio=None,
        target="0 failed",
        met=failed == 0,
    )
    # the window that ends at 10 minutes (or the first after): the slope runs from its end
    after = next(
        (i for i in range(len(windows)) if (i + 1) * args.window_s >= JUDGED_AFTER_S), None
    )
    if after is not None and after < len(windows) - 1:
        hours = (len(windows) - 1 - after) * args.window_s / 3600
        slopes = {n: (windows[-1][n] - windows[after][n]) / hours for n in names}
        slopes = {n: v for n, v in slopes.items() if not math.isnan(v)}  # no process killed then
        name = max(slopes, key=lambda n: slopes[n])
        minute = (after + 1) * args.window_s / 60
        headline.report(
            "soak",
            f"{name} RSS {slopes[name]:+.1f} MiB/h after {minute:g} min (steepest)",
            f"{name} RSS {windows[after][name]:.0f} MiB at {minute:g} min",
            ratio=None,
            target="every process under 5 MiB/h",
            met=all(slope < 5.0 for slope in slopes.values()),
        )
    else:
        first, last = windows[0], windows[-1]
        growth = {n: last[n] - first[n] for n in names}
        growth = {n: v for n, v in growth.items() if not math.isnan(v)}
        name = max(growth, key=lambda n: growth[n])
        headline.report(
            "soak",
            f"{name} RSS {growth[name]:+.1f} MiB over the run (most)",
            f"{name} RSS {first[name]:.0f} MiB after the first window",
            ratio=None,
            target=f"under 5 MiB/h after 10 min: not judged, {args.minutes:g} min run",
            met=None,
        )
    first_p99, last_p99 = windows[0]["lat_p99"], windows[-1]["lat_p99"]
    headline.report(
        "soak",
        f"last window latency p99 {last_p99:.0f} ms",
        f"first window {first_p99:.0f} ms",
        ratio=last_p99 / first_p99 if first_p99 else None,
    )


async def run(args: argparse.Namespace) -> int:
    model_dir = resolve_model(args.model)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    with tempfile.TemporaryDirectory(prefix="kvbaton-soak-") as tmp:
        discovery = f"file://{tmp}/discovery"
        serve = None
        try:
            flags = [
                *("--engine", "mocker", "--model", str(model_dir), "--namespace", NAMESPACE),
                *("--workers", str(args.workers), "--log-level", "WARNING"),
                *("--speedup-ratio", str(args.speedup_ratio)),
                *("--max-num-seqs", str(args.max_num_seqs)),
                *("--busy-kv-usage", "0", "--busy-prefill-tokens", "0"),  # no shedding
            ]
            serve = await asyncio.to_thread(start_serve, discovery, *flags)
            model = await wait_for_workers(serve.url, 0, args.workers, STARTUP_S)
            deployment = Deployment(serve.proc.pid, discovery)
            names = list(deployment.pids())
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
            async with httpx.AsyncClient(base_url=serve.url, timeout=600, limits=limits) as http:
                log(f"calibrating: {args.concurrency} clients, closed loop, {args.calibrate_s:g}s")
                capacity = await calibrate(http, args, model, vocab)
                rate = capacity * args.load
                log(f"capacity {capacity:.2f} req/s; soaking at {rate:.2f} req/s")
                windows = await soak(http, args, model, vocab, rate, deployment)
            report(args, capacity, rate, windows, names)
        finally:
            if serve is not None:
                stop(serve.proc)  # type: ignore[arg-type]
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--load", type=float, default=0.7, help="share of the capacity")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--speedup-ratio", type=float, default=0.2, help="the mocker's")
    parser.add_argument(
        "--max-num-seqs", type=int, default=8, help="per worker: what bounds its capacity"
    )
    parser.add_argument("--isl", type=int, default=512, help="prompt tokens")
    parser.add_argument("--osl", type=int, default=64, help="output tokens")
    parser.add_argument("--concurrency", type=int, default=64, help="calibration clients")
    parser.add_argument("--calibrate-s", type=float, default=60.0)
    parser.add_argument("--window-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2", help="whose tokenizer and config")
    parser.add_argument("--chaos", action="store_true", help="kill a random worker, repeatedly")
    parser.add_argument("--chaos-every-s", type=float, default=60.0)
    args = parser.parse_args()
    if not 0 < args.load <= 1 or args.workers < 1 or args.window_s <= 0:
        parser.error("--load must be in (0, 1], --workers >= 1, --window-s > 0")
    if args.chaos_every_s <= 0:
        parser.error("--chaos-every-s must be > 0")
    run_benchmark(run, args)


if __name__ == "__main__":
    main()
