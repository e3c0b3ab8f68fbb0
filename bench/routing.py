"""Routing benchmark: the KV-cache-aware router against round-robin, on mocker workers.

    python bench/routing.py [--rate 16] [--speedup-ratio 0.5] [--repeats 3]

For each router mode (round-robin, kv, kv approximate), `kvbaton serve --engine mocker
--workers 4 --router-mode MODE` is started and a multi-turn chat workload is sent to it at a
fixed request rate, streaming, with the official OpenAI wire format:
- `--system-prompts` distinct system prompts of `--system-tokens` tokens, shared by the sessions;
- `--sessions` sessions of `--turns` turns; each session's first user message has
  `--first-user-tokens` tokens (a document to talk about), later ones `--user-tokens`; each
  turn's prompt is the previous one plus the assistant's answer and a new user message;
- arrival j is at j / rate seconds; sessions start one after another over the first half of
  the run (session s's turn t is ordered by t + s * turns / sessions + a random jitter of up to
  half a turn), so that the run is a steady mix of new and old sessions rather than a burst of
  first turns; a turn is sent at its arrival or when its session's previous answer is
  complete, whichever is later.
The workload is generated from `--seed`, identical for every mode.

TTFT is taken at the response's first event (the frontend sends it with the first token), ITL
between events that carry text. Per mode it prints: prefix-cache hit rate (prompt tokens
served from cache / prompt tokens, from
`usage.prompt_tokens_details.cached_tokens`), the best possible hit rate for this workload (each
prompt's longest full-block prefix that any earlier prompt had, i.e. one infinite cache), TTFT
p50/p90, ITL p50, and each worker's share of the requests (from `x-kvbaton-worker`). Each figure
is the median over `--repeats` runs.

With `--num-kv-blocks` (each worker's pool) and KV tiers below it (`--kv-offload-gib`,
`--kv-disk-dir`: a fresh shared directory per run), the modes `kv-no-tier-credit` and
`kv-full-tier-credit` measure the router's tier credits (`--kv-tier-credits`) against its
default (`kv`); a hit then includes blocks loaded from a tier. The mode `kv-2-frontends`
runs two frontend replicas (`--frontends 2`), each routing the connections it gets on its own.

Then the router's decision cost: `find_matches` plus scoring for a 4,096-token prompt with 16
workers and 1M indexed blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from headline import at_least, at_most, report
from kvbaton.llm.hashing import hash_blocks
from kvbaton.llm.model_files import KNOWN_MODELS, pull, resolve_model, served_name
from kvbaton.llm.tokenizer import Tokenizer
from kvbaton.router import KvRouter
from kvbaton.router.indexer import KvIndexer
from serving import clean_env, log, pct, sse_chunks, stop

MODES = {
    "round-robin": ["--router-mode", "round-robin"],
    "kv": ["--router-mode", "kv"],
    "kv-approx": ["--router-mode", "kv", "--no-kv-events"],
    # with KV tiers (--kv-offload-gib / --kv-disk-dir): how much a hit below the pool counts
    "kv-no-tier-credit": ["--router-mode", "kv", "--kv-tier-credits", "0,0"],
    "kv-full-tier-credit": ["--router-mode", "kv", "--kv-tier-credits", "1,1"],
    # two frontend replicas on one port, each with its own router
    "kv-2-frontends": ["--router-mode", "kv", "--frontends", "2"],
}
DEFAULT_MODES = ["round-robin", "kv", "kv-approx"]
STARTUP_S = 180.0
REQUEST_TIMEOUT_S = 120.0
_READY = re.compile(r"ready at (http://\S+)/v1")
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]


# -- the workload ------------------------------------------------------------------------------
def words(rng: random.Random, tokenizer: Tokenizer, tokens: int) -> str:
    """Pseudo-words until the text has at least `tokens` tokens."""
    text = ""
    while len(tokenizer.encode(text, add_special_tokens=False)) < tokens:
        more = (
            "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(32)
        )
        text = f"{text} {' '.join(more)}".strip()
    return text


@dataclass
class Session:
    system: str
    users: list[str]
    answers: list[str] = field(default_factory=list)

    def messages(self, turn: int) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self.system}]
        for i in range(turn):
            out += [
                {"role": "user", "content": self.users[i]},
                {"role": "assistant", "content": self.answers[i]},
            ]
        return [*out, {"role": "user", "content": self.users[turn]}]


def workload(args: argparse.Namespace, tokenizer: Tokenizer) -> list[Session]:
    rng = random.Random(args.seed)
    systems = [words(rng, tokenizer, args.system_tokens) for _ in range(args.system_prompts)]
    return [
        Session(
            systems[s % len(systems)],
            [
                words(rng, tokenizer, args.first_user_tokens if t == 0 else args.user_tokens)
                for t in range(args.turns)
            ],
        )
        for s in range(args.sessions)
    ]


# -- one run -----------------------------------------------------------------------------------
@dataclass
class Result:
    session: int
    turn: int
    prompt: list[dict[str, str]]
    worker: str = ""
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], result: Result) -> str:
    """Stream one chat completion; fills `result`, returns the answer's text."""
    text: list[str] = []
    started = last = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())!r}")
        result.worker = response.headers["x-kvbaton-worker"]
        async for now, chunk in sse_chunks(response):
            if not result.ttft:  # the first event comes with the first token
                result.ttft = now - started
            if chunk.get("usage"):
                usage = chunk["usage"]
                result.prompt_tokens = usage["prompt_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                result.cached_tokens = details.get("cached_tokens") or 0
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                if text:
                    result.gaps.append(now - last)
                last = now
                text.append(chunk["choices"][0]["delta"]["content"])
    return "".join(text)


async def drive(
    url: str, model: str, sessions: list[Session], args: argparse.Namespace
) -> list[Result]:
    for session in sessions:
        session.answers.clear()
    results: list[Result] = []
    done = [asyncio.get_running_loop().create_future() for _ in sessions]
    for f in done:
        f.set_result(None)
    limits = httpx.Limits(max_connections=len(sessions) + 8)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def turn(
            j: int, s: int, previous: asyncio.Future[None], mine: asyncio.Future[None]
        ) -> None:
            await asyncio.sleep(max(0.0, start + j / args.rate - time.perf_counter()))
            await previous
            t = len(sessions[s].answers)  # the turns before it are answered
            messages = sessions[s].messages(t)
            result = Result(s, t, messages)
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": args.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            try:
                sessions[s].answers.append(await send(client, url, body, result))
                results.append(result)
                mine.set_result(None)
            except BaseException as exc:
                mine.set_exception(exc)
                raise

        jitter = random.Random(args.seed)
        spacing = args.turns / len(sessions)
        keys = {
            (t + s * spacing + jitter.random() / 2, s)
            for s in range(len(sessions))
            for t in range(args.turns)
        }
        arrivals = [s for _, s in sorted(keys)]  # a session's turns stay in order
        start = time.perf_counter()
        tasks = []
        for j, s in enumerate(arrivals):
            mine = asyncio.get_running_loop().create_future()
            tasks.append(asyncio.create_task(turn(j, s, done[s], mine)))
            done[s] = mine
        await asyncio.gather(*tasks)
    return results


@contextlib.contextmanager
def disk_tier(args: argparse.Namespace, mode: str) -> Iterator[Path | None]:
    """A fresh directory for one run's shared disk tier under `--kv-disk-dir` (no hits left from
    the run before), removed after the run; None without `--kv-disk-dir`."""
    if args.kv_disk_dir is None:
        yield None
        return
    disk = Path(tempfile.mkdtemp(prefix=f"routing-{mode}-", dir=args.kv_disk_dir))
    try:
        yield disk
    finally:
        shutil.rmtree(disk, ignore_errors=True)


def start_serve(
    args: argparse.Namespace, mode: str, disk: Path | None
) -> tuple[subprocess.Popen[str], str]:
    """`disk`: the workers' shared disk tier (None: none)."""
    env = clean_env()
    command = ["serve", "--engine", "mocker", "--model", args.model, "--http-port", "0"]
    command += ["--workers", str(args.workers), "--speedup-ratio", str(args.speedup_ratio)]
    command += ["--max-model-len", str(args.max_model_len)]
    if args.num_kv_blocks is not None:
        command += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.kv_offload_gib is not None:
        command += ["--kv-offload-gib", str(args.kv_offload_gib)]
    if disk is not None:
        command += ["--kv-disk-dir", str(disk)]
    if args.kv_overlap_score_weight is not None:
        command += ["--kv-overlap-score-weight", str(args.kv_overlap_score_weight)]
    if args.busy_kv_usage is not None:
        command += ["--busy-kv-usage", str(args.busy_kv_usage)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbaton", *command, "--log-level", "WARNING", *MODES[mode]],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + STARTUP_S
    for line in proc.stdout:
        if m := _READY.search(line):
            return proc, m.group(1)
        if time.monotonic() > deadline:
            break
    stop(proc)
    raise RuntimeError(f"kvbaton serve ({mode}) did not start")


async def wait_for_workers(url: str, model: str, workers: int) -> None:
    async with httpx.AsyncClient() as client:
        deadline = time.monotonic() + STARTUP_S
        while len((await client.get(f"{url}/health")).json()["models"].get(model, [])) < workers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"fewer than {workers} workers after {STARTUP_S:.0f}s")
            await asyncio.sleep(0.2)


# -- figures -----------------------------------------------------------------------------------


def best_hit_rate(results: list[Result], tokenizer: Tokenizer, block_size: int) -> float:
    """One infinite cache: each prompt's longest full-block prefix seen in an earlier prompt
    (leaving at least one token to compute), in the order the prompts were answered."""
    seen: set[int] = set()
    cached = total = 0
    for r in results:
        tokens = tokenizer.apply_chat_template(r.prompt)
        hashes = hash_blocks(tokens, block_size)
        usable = (len(tokens) - 1) // block_size
        hits = 0
        for h in hashes[:usable]:
            if h not in seen:
                break
            hits += 1
        cached += hits * block_size
        total += len(tokens)
        seen.update(hashes)
    return cached / total


def figures(results: list[Result], args: argparse.Namespace) -> dict[str, float]:
    shares: dict[str, int] = {}
    for r in results:
        shares[r.worker] = shares.get(r.worker, 0) + 1
    counts = sorted(shares.values(), reverse=True) + [0] * (args.workers - len(shares))
    return {
        "hit": sum(r.cached_tokens for r in results) / sum(r.prompt_tokens for r in results),
        "ttft50": pct([r.ttft for r in results], 0.5),
        "ttft90": pct([r.ttft for r in results], 0.9),
        "itl50": pct([g for r in results for g in r.gaps], 0.5),
        "max_share": counts[0] / len(results) * args.workers,  # x the fair share
        **{f"share{i}": c / len(results) for i, c in enumerate(counts)},
    }


# -- the router's decision cost ----------------------------------------------------------------
def decision_cost(
    num_blocks: int, workers: int, prompt_tokens: int, block_size: int
) -> dict[str, float]:
    """Microseconds per decision (median of 200): hashing the prompt's blocks, then
    `find_matches` plus scoring, for one prompt against an index of `num_blocks` blocks."""
    rng = random.Random(0)
    indexer = KvIndexer()
    per_worker = num_blocks // workers
    for w in range(workers):
        indexer.store(w + 1, (rng.getrandbits(64) for _ in range(per_worker)))
    prompt = [rng.randrange(50_000) for _ in range(prompt_tokens)]
    chain = hash_blocks(prompt, block_size)
    for w in range(workers):  # worker w caches the first w/workers of this prompt
        indexer.store(w + 1, chain[: len(chain) * w // workers])
    router = KvRouter(indexer, block_size)
    candidates = list(range(1, workers + 1))
    hashing, routing = [], []
    for _ in range(200):
        t0 = time.perf_counter()
        hashes = hash_blocks(prompt, block_size)
        t1 = time.perf_counter()
        router.rank_blocks(hashes, prompt_tokens, candidates)  # find_matches, loads, costs

        t2 = time.perf_counter()
        hashing.append(t1 - t0)
        routing.append(t2 - t1)
    return {
        "blocks": indexer.num_blocks,
        "hash_us": statistics.median(hashing) * 1e6,
        "route_us": statistics.median(routing) * 1e6,
    }


def tiers_said(args: argparse.Namespace) -> str:
    said = [f"a pool of {args.num_kv_blocks} blocks"] if args.num_kv_blocks else []
    if args.kv_offload_gib:
        said.append(f"a {args.kv_offload_gib:g} GiB host tier")
    if args.kv_disk_dir:
        said.append("a disk tier shared by the workers")
    return "".join(f", {s}" for s in said)


# -- main --------------------------------------------------------------------------------------
async def run(args: argparse.Namespace) -> None:
    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer(model_dir)
    model = served_name(args.model)
    log("generating the workload...")
    sessions = workload(args, tokenizer)
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in args.modes}
    best: list[float] = []
    for repeat in range(args.repeats):
        for mode in args.modes:
            log(f"run {repeat + 1}/{args.repeats}, router mode {mode}: starting serve...")
            with disk_tier(args, mode) as disk:
                proc, url = await asyncio.to_thread(start_serve, args, mode, disk)
                try:
                    await wait_for_workers(url, model, args.workers)
                    t0 = time.perf_counter()
                    results = await drive(url, model, sessions, args)
                    log(f"  {len(results)} requests in {time.perf_counter() - t0:.1f}s")
                finally:
                    await asyncio.to_thread(stop, proc)
            runs[mode].append(figures(results, args))
            best.append(best_hit_rate(results, tokenizer, args.block_size))
    best_rate = statistics.median(best)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    def of_best(mode: str) -> str:  # a workload with nothing to share has no best
        return f"{med(mode, 'hit') / best_rate:.0%}" if best_rate else "n/a"

    print(
        f"\n{args.sessions} sessions x {args.turns} turns, {args.system_prompts} system prompts of "
        f"{args.system_tokens} tokens, user turns of {args.first_user_tokens} tokens (the "
        f"first) and {args.user_tokens} (the others), "
        f"{args.max_tokens} output tokens, {args.rate:g} requests/s, {args.workers} mocker "
        f"workers (speedup {args.speedup_ratio:g}{tiers_said(args)}); medians of "
        f"{args.repeats} runs. Best possible hit rate for this workload: {best_rate:.1%}"
        f"{' (hits include blocks loaded from the tiers)' if tiers_said(args) else ''}.\n"
    )
    print(
        "| router | hit rate | of best | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | worker shares |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for mode in args.modes:
        shares = " / ".join(f"{med(mode, f'share{i}'):.0%}" for i in range(args.workers))
        print(
            f"| {mode} | {med(mode, 'hit'):.1%} | {of_best(mode)} | "
            f"{med(mode, 'ttft50') * 1e3:.1f} | {med(mode, 'ttft90') * 1e3:.1f} | "
            f"{med(mode, 'itl50') * 1e3:.2f} | {shares} |"
        )
    if "kv" in runs and "round-robin" in runs:
        ratio = med("kv", "ttft90") / med("round-robin", "ttft90")
        print(
            f"\nkv: hit rate {of_best('kv')} of the best (target >= 90%), "
            f"TTFT p90 {ratio:.2f}x round-robin's (target <= 0.5), busiest worker "
            f"{med('kv', 'max_share'):.2f}x its fair share (target <= 2)"
        )
    if "kv" in runs and "kv-2-frontends" in runs:
        points = (med("kv-2-frontends", "hit") - med("kv", "hit")) * 100
        print(
            f"kv-2-frontends: hit rate {points:+.1f} points from one frontend's (target: within "
            f"2), busiest worker {med('kv-2-frontends', 'max_share'):.2f}x its fair share "
            "(target <= 1.3)"
        )
    log("measuring the router's decision cost...")
    print(
        f"\nRouter decision for a {args.decision_prompt}-token prompt, "
        f"{args.decision_workers} workers, median of 200:\n"
    )
    print(
        "| block size | indexed blocks | hash the prompt µs | find_matches + scoring µs "
        "| total µs |"
    )
    print("|---:|---:|---:|---:|---:|")
    for bs in (64, 16):
        cost = decision_cost(args.decision_blocks, args.decision_workers, args.decision_prompt, bs)
        print(
            f"| {bs} | {cost['blocks']:,.0f} | {cost['hash_us']:.0f} | {cost['route_us']:.0f} | "
            f"{cost['hash_us'] + cost['route_us']:.0f} |"
        )
    print()
    headlines(runs, best_rate, args.workers)


def headlines(runs: dict[str, list[dict[str, float]]], best_rate: float, workers: int) -> None:
    """kv's hit rate against the best possible, its TTFT p90 against round-robin's, its busiest
    worker against the fair share; with `kv-2-frontends`, two frontends against one."""

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    fair = f"fair share {1 / workers:.0%}"
    if "kv" in runs:
        hit = med("kv", "hit")
        if best_rate:
            target, met = at_least(hit / best_rate, 0.9)
            report(
                "routing",
                f"kv hit rate {hit:.1%}",
                f"best possible {best_rate:.1%}",
                ratio=hit / best_rate,
                target=target,
                met=met,
            )
        if "round-robin" in runs:
            kv, rr = med("kv", "ttft90"), med("round-robin", "ttft90")
            target, met = at_most(kv / rr, 0.5)
            report(
                "routing",
                f"kv TTFT p90 {kv * 1e3:.1f} ms",
                f"round-robin {rr * 1e3:.1f} ms",
                ratio=kv / rr,
                target=target,
                met=met,
            )
        busiest = med("kv", "max_share")
        target, met = at_most(busiest, 2.0)
        report(
            "routing",
            f"kv busiest worker {busiest / workers:.0%} of requests",
            fair,
            ratio=busiest,
            target=target,
            met=met,
        )
    if "kv" in runs and "kv-2-frontends" in runs:
        one, two = med("kv", "hit"), med("kv-2-frontends", "hit")
        points = (two - one) * 100
        report(
            "routing",
            f"2 frontends hit rate {two:.1%} ({points:+.1f} points)",
            f"1 frontend {one:.1%}",
            ratio=two / one if one else None,
            target="at most 2 points below 1 frontend's",
            met=points >= -2.0,
        )
        busiest = med("kv-2-frontends", "max_share")
        target, met = at_most(busiest, 1.3)
        report(
            "routing",
            f"2 frontends busiest worker {busiest / workers:.0%} of requests",
            fair,
            ratio=busiest,
            target=target,
            met=met,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="whose tokenizer and template")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--modes",
        type=lambda s: s.split(","),
        default=DEFAULT_MODES,
        help=f"comma-separated, of: {', '.join(MODES)} (default: {','.join(DEFAULT_MODES)})",
    )
    parser.add_argument("--rate", type=float, default=16.0, help="requests/s")
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--first-user-tokens", type=int, default=4000)
    parser.add_argument("--user-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--speedup-ratio", type=float, default=0.5)
    parser.add_argument("--block-size", type=int, default=64, help="the mocker's (default 64)")
    parser.add_argument("--max-model-len", type=int, default=16384, help="the mocker's context")
    parser.add_argument("--kv-overlap-score-weight", type=float, help="(default: the router's)")
    parser.add_argument(
        "--busy-kv-usage", type=float, help="(default: the frontend's; 0: no shedding on KV use)"
    )
    parser.add_argument("--num-kv-blocks", type=int, help="each mocker's pool (default 16384)")
    parser.add_argument("--kv-offload-gib", type=float, help="each mocker's host tier")
    parser.add_argument("--kv-disk-dir", help="where each run's shared disk tier goes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decision-blocks", type=int, default=1_000_000)
    parser.add_argument("--decision-workers", type=int, default=16)
    parser.add_argument("--decision-prompt", type=int, default=4096)
    args = parser.parse_args()
    unknown = set(args.modes) - MODES.keys()
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.model in KNOWN_MODELS:
        pull(args.model, progress=log)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
