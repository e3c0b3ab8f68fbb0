"""Disaggregation benchmark: 1 prefill + 1 decode worker against 2 aggregated workers, on
mocker workers, under a mix of long-prompt and long-output requests.

    python bench/disagg.py [--rate 6] [--duration 20] [--speedup-ratio 1] [--repeats 3]

For each mode, a fresh deployment is started and the same seeded workload is sent to it:
- agg:    `kvbaton serve --engine mocker --mode agg --workers 2`
- disagg: `kvbaton serve --engine mocker --mode disagg --prefill-workers 1 --decode-workers 1`
The workload is a Poisson stream of `--rate` requests/s for `--duration` seconds (or
`--requests` requests), each a streaming `/v1/completions` request with a prompt of random
token ids (no two prompts share a block, so there are no prefix-cache hits), `ignore_eos`:
- long-prompt (a share of `--long-prompt-share`): `--long-prompt` prompt tokens (a range),
  `--long-prompt-output` output tokens;
- long-output (the others): `--long-output-prompt` prompt tokens, `--long-output` output tokens.
In an aggregated worker a long prompt is prefilled in the same engine steps as the other
requests' decodes (the mocker's chunked-prefill budget is `--max-num-batched-tokens`, 8192),
so each of those decodes waits for the prefill: that is the inter-token-latency tail that
disaggregation should cut. In disaggregated mode the prefill worker runs every prompt to its
first token and the decode worker only decodes.

TTFT is taken at the response's first SSE event (the frontend sends it with the first token),
ITL between successive events of a request that carry text (all gaps of all requests pooled;
"long-output ITL" pools only the long-output requests' gaps). Output tokens/s is the output
tokens of all requests (server-reported usage) over the time from the first arrival to the last
answer. Each figure is the median over `--repeats` repeats; each repeat runs both modes back to
back, and uses its own seed (the same for both modes), so that nothing is cached across runs.
Two more figures say where the time goes: the share of the long-output requests' decode time
spent in gaps over `--stall-ms` (stalls; by default 4 of the mocker's decode steps), and the gap
between a request's first two tokens (in disaggregated mode, the handoff from the prefill to the
decode worker). Then the CPU time each process of the deployment used, per output token and as
a share of one core, and the benchmark client's own. `--save FILE` keeps every request's
figures (JSON lines).

`--engine torch` runs the same comparison on the built-in engine (e.g. SmolLM2 on the CPU, with
much shorter prompts and outputs and a much lower rate than the defaults, which fit the mocker).

Checks (the run fails otherwise): every request answered 200 with its output tokens; in
disaggregated mode every request was prefilled by the prefill worker (`x-kvbaton-worker` of a
streamed response names the workers known when the first token is sent: with prefill-first,
only the prefill worker) and a non-streamed probe names both workers; in aggregated mode both
workers served requests; after the run, no worker holds KV blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from headline import report
from kvbaton.llm.model_files import KNOWN_MODELS, pull, resolve_model, served_name
from kvbaton.mocker.timing import MockerTiming
from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import DistributedRuntime
from serving import clean_env, descendants, log, pct, sse_chunks, stop

MODES = ("agg", "disagg")
STARTUP_S = 180.0
REQUEST_TIMEOUT_S = 120.0
BLOCKS_FREE_S = 20.0
NAMESPACE = "kvbaton"
_READY = re.compile(r"ready at (http://\S+)/v1")
_FIRST_TOKEN_ID = 256  # prompts avoid the tokenizer's special and byte tokens (if it has more)


def first_id(vocab_size: int) -> int:
    return min(_FIRST_TOKEN_ID, vocab_size // 2)


def span(text: str) -> tuple[int, int]:
    """ "a,b" -> (a, b); "a" -> (a, a)."""
    parts = [int(p) for p in text.split(",")]
    if len(parts) not in (1, 2) or min(parts) < 1 or parts[0] > parts[-1]:
        raise argparse.ArgumentTypeError(f"expected N or MIN,MAX (positive), got {text!r}")
    return parts[0], parts[-1]


# -- the workload ------------------------------------------------------------------------------
@dataclass
class Request:
    at: float  # seconds after the start
    kind: str  # "long-prompt" or "long-output"
    prompt: list[int]
    max_tokens: int


def workload(args: argparse.Namespace, seed: int, vocab_size: int) -> list[Request]:
    rng = random.Random(seed)
    requests: list[Request] = []
    at = 0.0
    while (args.requests and len(requests) < args.requests) or (
        not args.requests and at < args.duration
    ):
        if rng.random() < args.long_prompt_share:
            kind, prompt, output = "long-prompt", args.long_prompt, args.long_prompt_output
        else:
            kind, prompt, output = "long-output", args.long_output_prompt, args.long_output
        tokens = [
            rng.randrange(first_id(vocab_size), vocab_size) for _ in range(rng.randint(*prompt))
        ]
        requests.append(Request(at, kind, tokens, rng.randint(*output)))
        at += rng.expovariate(args.rate)
    return requests


# -- one run -----------------------------------------------------------------------------------
@dataclass
class Result:
    kind: str
    worker: str = ""
    lag: float = 0.0  # how late the client sent it
    ttft: float = 0.0
    end: float = 0.0  # perf_counter at its last event
    gaps: list[float] = field(default_factory=list)
    events: int = 0  # events with text
    output_tokens: int = 0
    expected_tokens: int = 0


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], result: Result) -> None:
    started = last = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())!r}")
        result.worker = response.headers.get("x-kvbaton-worker", "")
        async for now, chunk in sse_chunks(response):
            if not result.ttft:  # the first event comes with the first token
                result.ttft = now - started
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0].get("text"):
                if result.events:
                    result.gaps.append(now - last)
                last = now
                result.events += 1
        result.end = time.perf_counter()


async def warm_up(url: str, model: str, vocab_size: int) -> None:
    """A few short requests, so that the first measured ones pay no connection setup."""
    rng = random.Random(-1)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        for _ in range(4):
            prompt = [rng.randrange(first_id(vocab_size), vocab_size) for _ in range(64)]
            body = {"model": model, "prompt": prompt, "max_tokens": 4, "stream": True}
            await send(client, url, body, Result("warm-up"))


async def drive(url: str, model: str, requests: list[Request]) -> tuple[list[Result], float, float]:
    """Send `requests` at their arrival times; their results, the wall time from the first
    arrival to the last answer, and the client's CPU seconds over it."""
    results = [Result(r.kind, expected_tokens=r.max_tokens) for r in requests]
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def one(request: Request, result: Result) -> None:
            await asyncio.sleep(max(0.0, start + request.at - time.perf_counter()))
            result.lag = time.perf_counter() - start - request.at
            body = {
                "model": model,
                "prompt": request.prompt,
                "max_tokens": request.max_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            await send(client, url, body, result)

        cpu0 = time.process_time()
        start = time.perf_counter()
        await asyncio.gather(*(one(r, res) for r, res in zip(requests, results, strict=True)))
        wall = max(r.end for r in results) - start
        cpu = time.process_time() - cpu0
    return results, wall, cpu


# -- the deployment ----------------------------------------------------------------------------
MODE_FLAGS = {
    "agg": ["--mode", "agg", "--workers", "2"],
    "disagg": ["--mode", "disagg", "--prefill-workers", "1", "--decode-workers", "1"],
}


def start_serve(args: argparse.Namespace, mode: str, discovery: str) -> subprocess.Popen[str]:
    env = clean_env()
    command = ["serve", "--engine", args.engine, "--model", args.model, "--http-port", "0"]
    command += ["--discovery", discovery]
    if args.max_model_len is not None:
        command += ["--max-model-len", str(args.max_model_len)]
    if args.engine == "mocker":
        command += ["--speedup-ratio", str(args.speedup_ratio)]
    if args.max_num_batched_tokens is not None:
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if mode == "disagg" and args.transfer_order is not None:
        command += ["--transfer-order", args.transfer_order]
    return subprocess.Popen(
        [sys.executable, "-m", "kvbaton", *command, "--log-level", "WARNING", *MODE_FLAGS[mode]],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def ready_url(proc: subprocess.Popen[str]) -> str | None:
    """The URL `serve` prints once ready; None if it ended first."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := _READY.search(line):
            return m.group(1)
    return None


async def wait_for_workers(url: str, model: str, mode: str) -> tuple[list[str], list[str]]:
    """(decode or aggregated workers, prefill workers) once all are served."""
    want = (2, 0) if mode == "agg" else (1, 1)
    async with httpx.AsyncClient() as client:
        deadline = time.monotonic() + STARTUP_S
        while True:
            health = (await client.get(f"{url}/health")).json()
            workers = health["models"].get(model, [])
            prefill = health.get("prefill", {}).get(model, [])
            if (len(workers), len(prefill)) == want:
                return workers, prefill
            if time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: workers {workers}, prefill {prefill} (want {want})")
            await asyncio.sleep(0.2)


async def probe_workers(url: str, model: str, vocab_size: int) -> list[str]:
    """The workers that serve a non-streamed request (a streamed one's header is sent with the
    first token, before a decode worker is known)."""
    prompt = [random.Random(-2).randrange(first_id(vocab_size), vocab_size) for _ in range(100)]
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        body = {"model": model, "prompt": prompt, "max_tokens": 4}
        response = await client.post(f"{url}/v1/completions", json=body)
        response.raise_for_status()
        return response.headers["x-kvbaton-worker"].split(",")


async def blocks_in_use(discovery: str, mode: str) -> dict[str, int]:
    """KV blocks each worker holds, by instance id (hex)."""
    used: dict[str, int] = {}
    components = {"backend": 2} if mode == "agg" else {"backend": 1, "prefill": 1}
    async with DistributedRuntime(discovery) as runtime:
        for component, count in components.items():
            client = await runtime.endpoint(f"{NAMESPACE}.{component}.load_metrics").client(
                response_type=WorkerLoad
            )
            try:
                await client.wait_for_instances(30)
                with contextlib.suppress(TimeoutError):  # the others, a moment later
                    async with asyncio.timeout(10):
                        while len(client.instance_ids()) < count:
                            await client.wait_for_change()
                for instance in client.instance_ids():
                    loads: list[WorkerLoad] = [x async for x in client.direct(None, instance)]
                    used[f"{instance:x}"] = loads[0].kv_blocks_used
            finally:
                await client.close()
    return used


async def wait_blocks_free(discovery: str, mode: str) -> dict[str, int]:
    deadline = time.monotonic() + BLOCKS_FREE_S
    while True:
        used = await blocks_in_use(discovery, mode)
        if not any(used.values()) or time.monotonic() > deadline:
            return used
        await asyncio.sleep(0.5)


def cpu_seconds(serve_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each process of the deployment, by its role."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in descendants(serve_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        words = [w.decode() for w in cmdline]
        if "frontend" in words:
            role = "frontend"
        elif "--role" in words:
            role = words[words.index("--role") + 1]
        else:
            continue
        out[role] = out.get(role, 0.0) + (int(stat[11]) + int(stat[12])) / tick
    return out


# -- figures -----------------------------------------------------------------------------------


def figures(results: list[Result], wall: float, stall: float) -> dict[str, float]:
    out: dict[str, float] = {}
    groups = {
        "all": results,
        "lp": [r for r in results if r.kind == "long-prompt"],
        "lo": [r for r in results if r.kind == "long-output"],
    }
    for name, group in groups.items():
        out[f"ttft50_{name}"] = pct([r.ttft for r in group], 0.5)
        out[f"ttft99_{name}"] = pct([r.ttft for r in group], 0.99)
    gaps = [g for r in results for g in r.gaps]
    lo_gaps = [g for r in groups["lo"] for g in r.gaps]
    out["itl50"] = pct(gaps, 0.5)
    out["itl99"] = pct(gaps, 0.99)
    out["itl50_lo"] = pct(lo_gaps, 0.5)
    out["itl99_lo"] = pct(lo_gaps, 0.99)
    out["itl999_lo"] = pct(lo_gaps, 0.999)
    out["itlmean_lo"] = statistics.fmean(lo_gaps) if lo_gaps else float("nan")
    # where the decode stalled: the long-output requests' time in gaps of 4 decode steps or more
    out["stalled_lo"] = sum(g for g in lo_gaps if g > stall) / sum(lo_gaps) if lo_gaps else 0.0
    # the gap between the first two tokens: in disagg, the handoff from prefill to decode
    out["gap1_50"] = pct([r.gaps[0] for r in results if r.gaps], 0.5)
    tokens = sum(r.output_tokens for r in results)
    out["tok_s"] = tokens / wall
    out["tokens"] = tokens
    out["tokens_per_event"] = tokens / max(1, sum(r.events for r in results))
    out["lag99"] = pct([r.lag for r in results], 0.99)
    return out


# -- main --------------------------------------------------------------------------------------
def stop_and_clean(proc: subprocess.Popen[str], tmp: str) -> None:
    t0 = time.monotonic()
    stop(proc)
    shutil.rmtree(tmp, ignore_errors=True)
    if time.monotonic() - t0 > 5:
        log(f"  (a deployment took {time.monotonic() - t0:.0f}s to stop)")


async def one_run(
    args: argparse.Namespace,
    mode: str,
    requests: list[Request],
    vocab_size: int,
    stopping: list[asyncio.Future[None]],
) -> dict[str, float]:
    """Start a deployment, measure, and leave it stopping (in `stopping`): an idle deployment
    costs next to nothing, and stopping one can take seconds."""
    model = served_name(args.model)
    tmp = tempfile.mkdtemp(prefix="kvbaton-bench-disagg-")
    proc = start_serve(args, mode, f"file://{tmp}")
    try:
        url = await asyncio.wait_for(asyncio.to_thread(ready_url, proc), STARTUP_S)
        if url is None:
            raise RuntimeError(f"kvbaton serve ({mode}) exited before it was ready")
        workers, prefill = await wait_for_workers(url, model, mode)
        await warm_up(url, model, vocab_size)
        probe = await probe_workers(url, model, vocab_size)
        cpu0 = cpu_seconds(proc.pid)
        results, wall, client_cpu = await drive(url, model, requests)
        cpu1 = cpu_seconds(proc.pid)
        used = await wait_blocks_free(f"file://{tmp}", mode)
    finally:
        stopping.append(asyncio.ensure_future(asyncio.to_thread(stop_and_clean, proc, tmp)))
    if args.save:
        save(args.save, mode, requests, results)
    check(mode, results, workers, prefill, probe, used)
    fig = figures(results, wall, stall_s(args))
    for role, seconds in cpu1.items():
        fig[f"cpu_{role}"] = seconds - cpu0.get(role, 0.0)
    fig["cpu_client"] = client_cpu
    fig["wall"] = wall
    first = [r.worker for r in results]  # the workers named when the first token was sent
    fig["busiest"] = max(first.count(w) for w in set(first)) / len(first)
    fig["prefilled"] = sum(bool(set(w.split(",")) & set(prefill)) for w in first) / len(first)
    fig["probe_workers"] = len(probe)
    log(
        f"  {len(results)} requests in {wall:.1f}s: TTFT p50 {fig['ttft50_all'] * 1e3:.0f} ms, "
        f"ITL p99 {fig['itl99'] * 1e3:.1f} ms, {fig['tok_s']:.0f} output tokens/s, client send "
        f"lag p99 {fig['lag99'] * 1e3:.0f} ms; first tokens from {sorted(set(first))}"
    )
    return fig


def stall_s(args: argparse.Namespace) -> float:
    """`--stall-ms`, by default 4 decode steps of the mocker at no load."""
    if args.stall_ms is not None:
        return float(args.stall_ms) / 1e3
    return 4 * MockerTiming().decode_ms(0.0) / 1e3 / args.speedup_ratio


def check(
    mode: str,
    results: list[Result],
    workers: list[str],
    prefill: list[str],
    probe: list[str],
    used: dict[str, int],
) -> None:
    short = [r for r in results if r.output_tokens != r.expected_tokens]
    if short:
        raise RuntimeError(f"{mode}: {len(short)} requests ended early or were cut")
    served = {r.worker for r in results}
    if mode == "disagg":
        unprefilled = [r.worker for r in results if not set(r.worker.split(",")) & set(prefill)]
        if unprefilled:
            raise RuntimeError(
                f"{mode}: {len(unprefilled)} requests not prefilled on prefill worker {prefill}: "
                f"served by {sorted(set(unprefilled))}"
            )
        if sorted(probe) != sorted([*prefill, *workers]):
            raise RuntimeError(f"{mode}: probe served by {probe}, not {prefill} and {workers}")
    elif served != set(workers):
        raise RuntimeError(f"{mode}: requests served by {served}, workers {workers}")
    if any(used.values()):
        raise RuntimeError(f"{mode}: KV blocks still held {BLOCKS_FREE_S:.0f}s later: {used}")


def save(path: str, mode: str, requests: list[Request], results: list[Result]) -> None:
    """Append the run's requests as JSON lines (for a closer look)."""
    with open(path, "a") as f:
        for request, r in zip(requests, results, strict=True):
            line = {
                "mode": mode,
                "at": request.at,
                "kind": r.kind,
                "prompt_tokens": len(request.prompt),
                "output_tokens": r.output_tokens,
                "worker": r.worker,
                "lag": r.lag,
                "ttft": r.ttft,
                "gaps": r.gaps,
            }
            f.write(json.dumps(line) + "\n")


def vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


async def run(args: argparse.Namespace) -> None:
    vocab_size = vocab(resolve_model(args.model))
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    counts: dict[str, int] = {}
    stopping: list[asyncio.Future[None]] = []
    try:
        for repeat in range(args.repeats):
            requests = workload(args, args.seed + repeat, vocab_size)
            for kind in ("long-prompt", "long-output"):
                counts[kind] = counts.get(kind, 0) + sum(r.kind == kind for r in requests)
            for mode in MODES:
                log(f"run {repeat + 1}/{args.repeats}, {mode}: starting serve...")
                runs[mode].append(await one_run(args, mode, requests, vocab_size, stopping))
    finally:
        await asyncio.gather(*stopping)

    def med(mode: str, key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in runs[mode])

    def ms(mode: str, key: str) -> str:
        return f"{med(mode, key) * 1e3:.1f}"

    lp, lo = args.long_prompt, args.long_output
    engine = f"mocker (speedup {args.speedup_ratio:g})" if args.engine == "mocker" else "torch"
    if args.max_num_batched_tokens is not None:
        engine += f", --max-num-batched-tokens {args.max_num_batched_tokens}"
    print(
        f"\n{engine} workers, Poisson arrivals at "
        f"{args.rate:g} requests/s, {counts['long-prompt'] / args.repeats:.0f} long-prompt "
        f"requests ({lp[0]}-{lp[1]} prompt tokens, {args.long_prompt_output[0]}-"
        f"{args.long_prompt_output[1]} output) and {counts['long-output'] / args.repeats:.0f} "
        f"long-output requests ({args.long_output_prompt[0]}-{args.long_output_prompt[1]} prompt "
        f"tokens, {lo[0]}-{lo[1]} output) per run; medians of {args.repeats} runs per mode. "
        f"Times in ms.\n"
    )
    print(
        "| mode | TTFT p50 | TTFT p99 | long-prompt TTFT p50 | long-prompt TTFT p99 "
        "| long-output TTFT p50 | long-output TTFT p99 | ITL p50 | ITL p99 "
        "| long-output ITL p99 | long-output ITL p99.9 | long-output ITL mean | output tok/s |"
    )
    print("|---|" + "---:|" * 12)
    keys = [
        "ttft50_all",
        "ttft99_all",
        "ttft50_lp",
        "ttft99_lp",
        "ttft50_lo",
        "ttft99_lo",
        "itl50",
        "itl99",
        "itl99_lo",
        "itl999_lo",
        "itlmean_lo",
    ]
    for mode in MODES:
        cells = [ms(mode, k) for k in keys]
        print(f"| {mode} | {' | '.join(cells)} | {med(mode, 'tok_s'):.0f} |")
    ratios = [f"{med('disagg', k) / med('agg', k):.2f}" for k in [*keys, "tok_s"]]
    print(f"| disagg / agg | {' | '.join(ratios)} |")

    print("\nCPU time per output token (µs) and as a share of one core, medians:\n")
    roles = {"agg": ["frontend", "agg"], "disagg": ["frontend", "prefill", "decode"]}
    print("| mode | process | µs per output token | share of a core |")
    print("|---|---|---:|---:|")
    for mode in MODES:
        for role in [*roles[mode], "client"]:
            per_token = statistics.median(
                r.get(f"cpu_{role}", 0.0) / r["tokens"] * 1e6 for r in runs[mode]
            )
            share = statistics.median(r.get(f"cpu_{role}", 0.0) / r["wall"] for r in runs[mode])
            name = "workers (2)" if role == "agg" else role
            print(f"| {mode} | {name} | {per_token:.0f} | {share:.0%} |")
    print(
        f"\nServed by: agg, 2 workers, the busiest sent {med('agg', 'busiest'):.0%} of the "
        f"first tokens; disagg, {med('disagg', 'prefilled'):.0%} of the first tokens from the "
        f"prefill worker, and a non-streamed probe served by "
        f"{med('disagg', 'probe_workers'):.0f} workers (prefill, decode)."
    )
    print(
        f"Long-output requests' decode time spent in gaps over {stall_s(args) * 1e3:.0f} ms: "
        f"agg {med('agg', 'stalled_lo'):.1%}, disagg {med('disagg', 'stalled_lo'):.1%}. The gap "
        f"between a request's first two tokens (in disagg: the handoff from the prefill to the "
        f"decode worker), p50: agg {ms('agg', 'gap1_50')} ms, disagg {ms('disagg', 'gap1_50')} ms."
    )
    tokens_per_event = statistics.median(r["tokens_per_event"] for m in MODES for r in runs[m])
    lag = max(med(m, "lag99") for m in MODES)
    print(
        f"\nOutput tokens per text event: {tokens_per_event:.3f} (a token that ends inside a "
        f"UTF-8 character is sent with the next); client send lag p99 {lag * 1e3:.1f} ms."
    )
    print()
    # the tail disaggregation cuts, and what it costs; no target is set for either
    headlines = (("itl999_lo", "long-output ITL p99.9"), ("ttft99_lp", "long-prompt TTFT p99"))
    for key, what in headlines:
        disagg, agg = med("disagg", key), med("agg", key)
        report(
            "disagg",
            f"disagg {what} {disagg * 1e3:.1f} ms",
            f"agg {agg * 1e3:.1f} ms",
            ratio=disagg / agg if agg else None,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="whose tokenizer and vocabulary")
    parser.add_argument("--engine", choices=["mocker", "torch"], default="mocker")
    parser.add_argument("--rate", type=float, default=6.0, help="requests/s (Poisson)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--requests", type=int, help="this many requests (instead of duration)")
    parser.add_argument("--long-prompt-share", type=float, default=0.5)
    parser.add_argument("--long-prompt", type=span, default=(4000, 8000), metavar="MIN,MAX")
    parser.add_argument("--long-prompt-output", type=span, default=(8, 16), metavar="MIN,MAX")
    parser.add_argument("--long-output-prompt", type=span, default=(100, 200), metavar="MIN,MAX")
    parser.add_argument("--long-output", type=span, default=(200, 400), metavar="MIN,MAX")
    parser.add_argument("--speedup-ratio", type=float, default=1.0, help="the mocker's")
    parser.add_argument("--max-num-batched-tokens", type=int, help="(default: the engine's)")
    parser.add_argument(
        "--transfer-order", choices=["prefill-first", "decode-first"], help="(default: serve's)"
    )
    parser.add_argument("--max-model-len", type=int, help="(default: the model's)")
    parser.add_argument(
        "--stall-ms", type=float, help="a gap this long is a stall (default: 4 mocker steps)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", metavar="FILE", help="append each request's figures (JSON lines)")
    args = parser.parse_args()
    if args.model in KNOWN_MODELS:
        pull(args.model, progress=log)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
