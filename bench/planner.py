"""Planner benchmark: a mocker cluster under a load that steps up 4x and back down, served by
a fixed 1 prefill + 1 decode deployment, a fixed deployment sized for the peak, and the planner.

    python bench/planner.py [--duration 180] [--peak-share 0.333] [--seed 0] [--base-rate 1]

The trace (seeded, the same for the three runs): Poisson arrivals at `--base-rate` requests/s,
`--peak-factor` (4) x that for the middle `--peak-share` of `--duration` (default: the middle
third; a peak shorter than the trough, as daily traffic has), then the base rate again; each a
streaming `/v1/completions` request of `--isl` random prompt token ids (distinct per request:
no prefix-cache hits) and `--osl` output tokens (`ignore_eos`, `min_tokens`). Per request,
client-side: TTFT (the first SSE event) and ITL (the mean gap between its text events, from the
first to the last). A request that fails or ends short is lost.

Each configuration is its own deployment on a private file discovery directory: `kvbaton
frontend` on a free port (load shedding off: an undersized deployment queues, as it did before
shedding existed, rather than refusing) and mocker workers (`kvbaton worker --engine mocker
--role prefill|decode`, started and stopped by PID through the planner's `LocalConnector`) on
the tokenizer and config of `--model` (default smollm2, pulled if missing; the mocker reads no
weights). The mocker's timings are Dynamo's defaults divided by `--speedup-ratio` (below 1:
slower, so that the mocker's time, not the 2 cores' Python, is what saturates). Prefill workers
take one prompt per step (`--max-num-batched-tokens` = the prompt length), which is what the
planner's model of a prefill worker assumes; decode workers have `--decode-kv-blocks` blocks
(the mocker's step time grows with KV usage, so concurrent decodes slow each other).

The profile the planner (and the peak sizing) uses is computed from the mocker's timing model,
not measured: prefill t(n) = MockerTiming.prefill_ms(n) / speedup, decode itl(b) =
MockerTiming.decode_ms(u) / speedup at the KV usage u of b sequences of `--isl` + `--osl`/2
tokens (`--profile FILE` uses a `kvbaton profile` file instead). Targets are relative to it:
TTFT = `--ttft-factor` x t(isl), ITL = `--itl-factor` x itl(1).

Configurations: fixed-1P1D; fixed-peak, sized by the planner's own `ReplicaPlanner` at the peak
rate; planner, starting at 1P1D with `Planner` (interval `--interval`, `--predictor`, scale-down
patience `--patience`) running in this process with `LocalConnector`, scaling during the run.

Printed per run: requests sent, completed, lost; goodput (the share of requests meeting both
targets); p50/p90 TTFT and ITL; worker-seconds (the number of live worker processes, draining
ones included, sampled every 0.5 s and integrated from the first arrival to the last answer).
Then planner vs peak: goodput difference (points) and worker-seconds ratio against the issue's
target (goodput within 10 points of the peak-sized deployment, at most 70% of its
worker-seconds, no request lost), and the worker-seconds a planner that followed the phases with
no delay would use (the floor for this trace).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

import headline
from kvbaton.llm.model_files import resolve_model
from kvbaton.mocker.timing import MockerTiming
from kvbaton.planner.connectors.local import LocalConnector
from kvbaton.planner.observer import Observer
from kvbaton.planner.perf_model import decode_capacity, prefill_capacity, prefill_ms
from kvbaton.planner.planner import Planner, Predictors
from kvbaton.planner.predictors import make_predictor
from kvbaton.planner.replicas import ReplicaPlanner, ReplicaPolicy
from kvbaton.planner.types import Decision, Observation, Profile, ProfilePoint, Targets
from kvbaton.runtime import DistributedRuntime
from serving import (
    STARTUP_S,
    Frontend,
    clean_env,
    log,
    pct,
    run_benchmark,
    sse_chunks,
    start_frontend,
    stop,
    wait_for_workers,
)

NAMESPACE = "benchplanner"
REQUEST_TIMEOUT_S = 300.0
SAMPLE_S = 0.5
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
CONFIGS = ("fixed-1P1D", "fixed-peak", "planner")


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


# -- the trace ---------------------------------------------------------------------------------
@dataclass
class Request:
    at: float  # seconds after the start
    prompt: list[int]
    max_tokens: int


def peak_window(args: argparse.Namespace) -> tuple[float, float]:
    """The peak's start and end (s): `--peak-share` of `--duration`, centred."""
    base = args.duration * (1.0 - args.peak_share) / 2
    return base, args.duration - base


def rate_at(args: argparse.Namespace, at: float) -> float:
    start, end = peak_window(args)
    return args.base_rate * (args.peak_factor if start <= at < end else 1.0)


def trace(args: argparse.Namespace, vocab: int) -> list[Request]:
    """Poisson arrivals at the rate of the phase each falls in (a piecewise-constant rate:
    exponential gaps at the current rate; a gap that crosses a phase boundary is redrawn from
    the boundary at the new rate, which is exact for a Poisson process)."""
    rng = random.Random(args.seed)
    lo = min(16, vocab // 2)  # prompts avoid the special tokens (the first ids)
    boundaries = [*peak_window(args), args.duration]
    requests: list[Request] = []
    at = 0.0
    while True:
        gap = rng.expovariate(rate_at(args, at))
        nxt = next(b for b in boundaries if b > at)
        if at + gap >= nxt:
            at = nxt
            if at >= args.duration:
                return requests
            continue
        at += gap
        prompt = [rng.randrange(lo, vocab) for _ in range(args.isl)]
        requests.append(Request(at, prompt, args.osl))


# -- the profile and targets -------------------------------------------------------------------
def model_profile(args: argparse.Namespace) -> Profile:
    """The mocker's curves from its timing model (see the module's docstring)."""
    timing = MockerTiming(speedup_ratio=args.speedup_ratio)
    s = args.speedup_ratio
    prefill = [ProfilePoint(n, timing.prefill_ms(n) / s) for n in (128, 256, 512, 1024, 2048)]
    if args.isl > 2048:
        prefill.append(ProfilePoint(args.isl, timing.prefill_ms(args.isl) / s))
    blocks = math.ceil((args.isl + args.osl / 2) / BLOCK_SIZE)
    decode = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        usage = min(1.0, b * blocks / args.decode_kv_blocks)
        decode.append(ProfilePoint(b, timing.decode_ms(usage) / s))
    return Profile(
        engine="mocker", model=args.model, prefill=prefill, decode=decode, decode_context=args.isl
    )


def load_profile(path: str) -> Profile:
    return Profile.from_json(Path(path).read_bytes())


def targets_for(args: argparse.Namespace, profile: Profile) -> Targets:
    return Targets(
        ttft_ms=args.ttft_factor * prefill_ms(profile, args.isl),
        itl_ms=args.itl_factor * profile.decode[0].ms,
    )


def policy(args: argparse.Namespace) -> ReplicaPolicy:
    return ReplicaPolicy(
        max_prefill=args.max_workers_per_role,
        max_decode=args.max_workers_per_role,
        max_step=args.max_step,
        scale_down_patience=args.patience,
    )


def size_at(
    args: argparse.Namespace, profile: Profile, targets: Targets, rate: float
) -> tuple[int, int]:
    """The planner's own model at `rate` (no pacing: any step at once)."""
    wide = ReplicaPolicy(max_prefill=64, max_decode=64, max_step=64)
    decision = ReplicaPlanner(profile, targets, wide).decide(
        rate,
        args.isl,
        args.osl,
        0.0,
        Observation(interval_s=1.0),
        0,
        0,
    )
    return decision.prefill, decision.decode


# -- one request -------------------------------------------------------------------------------
@dataclass
class Result:
    ttft: float = math.nan
    itl: float = math.nan  # mean gap between text events
    end: float = 0.0
    output_tokens: int = 0
    error: str = ""

    def lost(self, expected: int) -> bool:
        return bool(self.error) or self.output_tokens != expected


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], result: Result) -> None:
    started = time.perf_counter()
    first = last = 0.0
    events = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())!r}")
            async for now, chunk in sse_chunks(response):
                if math.isnan(result.ttft):
                    result.ttft = now - started
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    if not events:
                        first = now
                    last = now
                    events += 1
    except Exception as exc:  # lost: counted, not raised
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter()
    if events >= 2:
        result.itl = (last - first) / (events - 1)


async def drive(url: str, model: str, requests: list[Request]) -> tuple[list[Result], float, float]:
    """Send `requests` at their arrival times; (results, start, end) in perf_counter time."""
    results = [Result() for _ in requests]
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=64)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def one(request: Request, result: Result) -> None:
            await asyncio.sleep(max(0.0, start + request.at - time.perf_counter()))
            body = {
                "model": model,
                "prompt": request.prompt,
                "max_tokens": request.max_tokens,
                "min_tokens": request.max_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            await send(client, url, body, result)

        start = time.perf_counter()
        await asyncio.gather(*(one(r, res) for r, res in zip(requests, results, strict=True)))
    return results, start, max([r.end for r in results], default=start)


async def warm_up(url: str, model: str, vocab: int) -> None:
    rng = random.Random(-1)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        for _ in range(3):
            prompt = [rng.randrange(16, vocab) for _ in range(64)]
            body = {"model": model, "prompt": prompt, "max_tokens": 4, "stream": True}
            result = Result()
            await send(client, url, body, result)
            if result.error:
                raise RuntimeError(f"warm-up request failed: {result.error}")


# -- the deployment ----------------------------------------------------------------------------
def worker_args(args: argparse.Namespace, model_dir: Path, discovery: str) -> dict[str, list[str]]:
    common = ["--engine", "mocker", "--model", str(model_dir), "--namespace", NAMESPACE]
    common += ["--discovery", discovery, "--block-size", str(BLOCK_SIZE)]
    common += ["--max-model-len", str(MAX_MODEL_LEN), "--speedup-ratio", str(args.speedup_ratio)]
    common += ["--log-level", "WARNING"]
    return {
        "prefill": [
            *("--role", "prefill", *common, "--max-num-batched-tokens", str(args.isl)),
            *("--num-kv-blocks", str(args.prefill_kv_blocks)),
        ],
        "decode": ["--role", "decode", *common, "--num-kv-blocks", str(args.decode_kv_blocks)],
    }


def live_workers(connector: LocalConnector) -> int:
    """Worker processes alive: serving, starting or draining."""
    return (
        len(connector.pids("prefill"))
        + len(connector.pids("decode"))
        + len(connector.stopping_pids())
    )


# -- one run -----------------------------------------------------------------------------------
@dataclass
class RunFigures:
    config: str
    workers: str
    results: list[Result]
    wall: float
    worker_seconds: float
    scale_downs: int = 0
    max_workers: int = 0
    decisions: list[str] = field(default_factory=list)


async def one_run(
    args: argparse.Namespace,
    config: str,
    model_dir: Path,
    requests: list[Request],
    sizes: tuple[int, int],
    profile: Profile,
    targets: Targets,
) -> RunFigures:
    tmp = Path(tempfile.mkdtemp(prefix="kvbaton-bench-planner-"))
    discovery = f"file://{tmp / 'discovery'}"
    frontend: Frontend | None = None
    connector = LocalConnector(
        worker_args(args, model_dir, discovery), env=clean_env(), log_dir=tmp / "logs"
    )
    samples: list[tuple[float, int]] = []
    planner: Planner | None = None
    planner_task: asyncio.Task[None] | None = None
    runtime: DistributedRuntime | None = None
    observer: Observer | None = None
    decisions: list[str] = []
    scale_downs = 0
    try:
        # No load shedding: what the planner does not scale for is measured, not refused.
        no_shedding = ("--busy-kv-usage", "0", "--busy-prefill-tokens", "0")
        frontend = await asyncio.to_thread(start_frontend, discovery, NAMESPACE, *no_shedding)
        prefill, decode = sizes
        await connector.scale("prefill", prefill)
        await connector.scale("decode", decode)
        model = await wait_for_workers(frontend.url, prefill, decode, STARTUP_S)
        await warm_up(frontend.url, model, vocab_size(model_dir))
        t0 = time.perf_counter()

        if config == "planner":
            runtime = DistributedRuntime(discovery)
            observer = Observer(runtime, frontend.url, NAMESPACE)
            predictors = Predictors(*(make_predictor(**predictor_spec(args)) for _ in range(3)))

            def on_decision(obs: Observation, d: Decision) -> None:
                nonlocal scale_downs
                at = time.perf_counter() - t0
                if d.prefill < d.current_prefill or d.decode < d.current_decode:
                    scale_downs += 1
                if (d.prefill, d.decode) != (d.current_prefill, d.current_decode):
                    line = (
                        f"t={at:5.1f}s rate {obs.request_rate:.2f}/s (predicted "
                        f"{d.predicted_request_rate:.2f}), TTFT {obs.ttft_ms:.0f} ms, ITL "
                        f"{obs.itl_ms:.0f} ms, queued {obs.queued_prefill}: prefill "
                        f"{d.current_prefill} -> {d.prefill}, decode {d.current_decode} -> "
                        f"{d.decode}"
                    )
                    decisions.append(line)
                    log(f"  planner: {line}")

            planner = Planner(
                observer,
                connector,
                ReplicaPlanner(profile, targets, policy(args)),
                predictors,
                interval_s=args.interval,
                on_decision=on_decision,
            )
            planner_task = asyncio.create_task(planner.run())

        stop_sampling = asyncio.Event()

        async def sample() -> None:
            while not stop_sampling.is_set():
                samples.append((time.perf_counter(), live_workers(connector)))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop_sampling.wait(), SAMPLE_S)

        sampler = asyncio.create_task(sample())
        log(f"{config}: sending {len(requests)} requests over {args.duration:g}s...")
        results, start, end = await drive(frontend.url, model, requests)
        stop_sampling.set()
        await sampler
        if planner is not None and planner_task is not None:
            planner.stop()
            await planner_task
    finally:
        if planner is not None and planner_task is not None and not planner_task.done():
            planner.stop()
            planner_task.cancel()
            with contextlib.suppress(BaseException):
                await planner_task
        if observer is not None:
            with contextlib.suppress(Exception):
                await observer.close()
        if runtime is not None:
            with contextlib.suppress(Exception):
                await runtime.shutdown()
        await connector.close()
        if frontend is not None:
            await asyncio.to_thread(stop, frontend.proc)  # type: ignore[arg-type]
        shutil.rmtree(tmp, ignore_errors=True)

    worker_seconds = integrate(samples, start, end)
    workers = (
        f"{sizes[0]}P+{sizes[1]}D"
        if config != "planner"
        else f"{sizes[0]}P+{sizes[1]}D, scaled (at most {max(n for _, n in samples)} live)"
    )
    fig = RunFigures(
        config,
        workers,
        results,
        end - start,
        worker_seconds,
        scale_downs,
        max((n for _, n in samples), default=0),
        decisions,
    )
    lost = sum(r.lost(args.osl) for r in results)
    log(
        f"  {config}: {len(results)} requests, {lost} lost, goodput "
        f"{goodput(results, targets, args.osl):.1%}, {worker_seconds:.0f} worker-seconds "
        f"over {fig.wall:.0f}s"
    )
    for r in results:
        if r.error:
            log(f"    lost: {r.error}")
            break
    return fig


def integrate(samples: list[tuple[float, int]], start: float, end: float) -> float:
    """The integral over [start, end] of the sampled worker count (a step function)."""
    total = 0.0
    for (t, n), (t_next, _) in zip(samples, [*samples[1:], (end, 0)], strict=True):
        lo, hi = max(t, start), min(t_next, end)
        if hi > lo:
            total += n * (hi - lo)
    return total


def predictor_spec(args: argparse.Namespace) -> dict[str, Any]:
    if args.predictor == "moving-average":
        return {"name": "moving-average", "window": args.window}
    return {"name": args.predictor, "interval_s": args.interval}


def goodput(results: list[Result], targets: Targets, osl: int) -> float:
    good = sum(
        not r.lost(osl) and r.ttft * 1e3 <= targets.ttft_ms and r.itl * 1e3 <= targets.itl_ms
        for r in results
    )
    return good / len(results) if results else math.nan


# -- main --------------------------------------------------------------------------------------
async def run(args: argparse.Namespace) -> int:
    model_dir = resolve_model(args.model)
    profile = load_profile(args.profile) if args.profile else model_profile(args)
    targets = targets_for(args, profile)
    peak = size_at(args, profile, targets, args.base_rate * args.peak_factor)
    base = size_at(args, profile, targets, args.base_rate)
    p_cap = prefill_capacity(profile, targets, args.isl) / args.isl
    d_cap = decode_capacity(profile, targets) / args.osl
    log(
        f"profile ({'from ' + args.profile if args.profile else 'the mocker timing model'}): "
        f"prefill of {args.isl} tokens {prefill_ms(profile, args.isl):.0f} ms, decode ITL at "
        f"batch 1 {profile.decode[0].ms:.0f} ms; targets TTFT {targets.ttft_ms:.0f} ms, ITL "
        f"{targets.itl_ms:.0f} ms; one worker sustains {p_cap:.2f} req/s (prefill), "
        f"{d_cap:.2f} req/s (decode); peak {args.base_rate * args.peak_factor:g} req/s -> "
        f"{peak[0]} prefill + {peak[1]} decode"
    )
    requests = trace(args, vocab_size(model_dir))
    sizes = {"fixed-1P1D": (1, 1), "fixed-peak": peak, "planner": (1, 1)}
    runs = []
    for config in args.configs:
        runs.append(
            await one_run(args, config, model_dir, requests, sizes[config], profile, targets)
        )
    return report(args, runs, targets, peak, base, len(requests))


def report(
    args: argparse.Namespace,
    runs: list[RunFigures],
    targets: Targets,
    peak: tuple[int, int],
    base: tuple[int, int],
    sent: int,
) -> int:
    start, end = peak_window(args)
    print(
        f"\nmocker workers (speedup {args.speedup_ratio:g}), {args.isl}-token prompts, "
        f"{args.osl} output tokens; Poisson arrivals at {args.base_rate:g} req/s for {start:g}s, "
        f"{args.base_rate * args.peak_factor:g} req/s for {end - start:g}s, {args.base_rate:g} "
        f"req/s for {args.duration - end:g}s (seed {args.seed}, {sent} requests). Targets: TTFT <= "
        f"{targets.ttft_ms:.0f} ms, ITL <= {targets.itl_ms:.0f} ms. Planner: interval "
        f"{args.interval:g}s, predictor {args.predictor}, scale-down patience {args.patience}, "
        f"max step {args.max_step}. Peak sizing (ReplicaPlanner at the peak rate): "
        f"{peak[0]}P+{peak[1]}D; at the base rate {base[0]}P+{base[1]}D. Times in ms.\n"
    )
    print(
        "| configuration | workers | sent | completed | lost | goodput | TTFT p50 | TTFT p90 "
        "| ITL p50 | ITL p90 | worker-seconds |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    by: dict[str, tuple[float, float, int]] = {}
    for fig in runs:
        res = fig.results
        lost = sum(r.lost(args.osl) for r in res)
        ttfts = [r.ttft * 1e3 for r in res if not math.isnan(r.ttft)]
        itls = [r.itl * 1e3 for r in res if not math.isnan(r.itl)]
        gp = goodput(res, targets, args.osl)
        by[fig.config] = (gp, fig.worker_seconds, lost)
        print(
            f"| {fig.config} | {fig.workers} | {len(res)} | {len(res) - lost} | {lost} "
            f"| {gp:.1%} | {pct(ttfts, 0.5):.0f} | {pct(ttfts, 0.9):.0f} | {pct(itls, 0.5):.0f} "
            f"| {pct(itls, 0.9):.0f} | {fig.worker_seconds:.0f} |"
        )
    planner_fig = next((f for f in runs if f.config == "planner"), None)
    if planner_fig is not None:
        print(
            f"\nPlanner: {len(planner_fig.decisions)} scaling decisions, {planner_fig.scale_downs} "
            f"of them scale-downs, at most {planner_fig.max_workers} live workers."
        )
        for line in planner_fig.decisions:
            print(f"- {line}")
    if "planner" in by and "fixed-peak" in by:
        (gp_p, ws_p, lost_p), (gp_k, ws_k, _) = by["planner"], by["fixed-peak"]
        diff = (gp_p - gp_k) * 100
        ratio = ws_p / ws_k if ws_k else math.nan
        met = diff >= -10 and ratio <= 0.70 and lost_p == 0
        ideal = (sum(base) * (1.0 - args.peak_share) + sum(peak) * args.peak_share) / sum(peak)
        print(
            f"\nplanner vs fixed-peak: goodput {diff:+.1f} points, worker-seconds "
            f"{ratio:.0%} of the peak deployment's, {lost_p} lost; target (goodput within 10 "
            f"points, at most 70% of the worker-seconds, nothing lost): "
            f"{'met' if met else 'NOT met'}. (A planner that followed the trace's phases "
            f"with no delay, at the sizes above, would use {ideal:.0%}.)"
        )
        print()
        report_headlines(by)
    return 0


def report_headlines(by: dict[str, tuple[float, float, int]]) -> None:
    """The planner against the peak-sized deployment: goodput, worker-seconds, requests lost."""
    (gp_p, ws_p, lost_p), (gp_k, ws_k, lost_k) = by["planner"], by["fixed-peak"]
    diff = (gp_p - gp_k) * 100
    headline.report(
        "planner",
        f"planner goodput {gp_p:.1%} ({diff:+.1f} points)",
        f"fixed-peak {gp_k:.1%}",
        ratio=gp_p / gp_k if gp_k else None,
        target="at most 10 points below fixed-peak's",
        met=diff >= -10,
    )
    ratio = ws_p / ws_k if ws_k else math.nan
    target, met = headline.at_most(ratio, 0.70)
    headline.report(
        "planner",
        f"planner {ws_p:.0f} worker-seconds",
        f"fixed-peak {ws_k:.0f} worker-seconds",
        ratio=ratio if ws_k else None,
        target=target,
        met=met,
    )
    headline.report(
        "planner",
        f"planner {lost_p} requests lost",
        f"fixed-peak {lost_k} lost",
        ratio=None,
        target="0 lost",
        met=lost_p == 0,
    )


def add_shared_flags(parser: argparse.ArgumentParser) -> None:
    """The trace's, the mocker's and the planner's flags, shared with bench/planner_replay.py."""
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of arrivals")
    parser.add_argument(
        "--peak-share", type=float, default=1 / 3, help="of --duration at the peak, centred"
    )
    parser.add_argument("--speedup-ratio", type=float, default=0.05, help="the mocker's")
    parser.add_argument("--base-rate", type=float, default=1.0, help="requests/s")
    parser.add_argument("--peak-factor", type=float, default=4.0)
    parser.add_argument("--isl", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--osl", type=int, default=32, help="output tokens")
    parser.add_argument("--decode-kv-blocks", type=int, default=8192)
    parser.add_argument("--ttft-factor", type=float, default=5.0, help="x prefill time")
    parser.add_argument("--itl-factor", type=float, default=3.0, help="x ITL at batch 1")
    parser.add_argument("--interval", type=float, default=5.0, help="planner, seconds")
    parser.add_argument("--max-step", type=int, default=2)
    parser.add_argument("--max-workers-per-role", type=int, default=8)
    parser.add_argument("--window", type=int, default=3, help="moving-average intervals")
    parser.add_argument(
        "--model", default="smollm2", help="whose tokenizer and config the mocker uses"
    )


def check_shared_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 0.0 < args.peak_share <= 1.0:
        parser.error("--peak-share must be in (0, 1]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shared_flags(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-kv-blocks", type=int, default=4096)
    parser.add_argument("--patience", type=int, default=1, help="scale-down patience")
    parser.add_argument(
        "--predictor",
        default="level-shift",
        choices=["constant", "moving-average", "holt", "level-shift"],
    )
    parser.add_argument("--profile", help="a `kvbaton profile` file (default: the timing model)")
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"which runs, of {','.join(CONFIGS)}"
    )
    args = parser.parse_args()
    check_shared_flags(parser, args)
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}")
    run_benchmark(run, args)


if __name__ == "__main__":
    main()
