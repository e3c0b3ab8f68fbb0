"""The serving stack against NVIDIA Dynamo's (issue 32): `kvbaton serve --engine mocker` beside
Dynamo 1.6.1's frontend and mocker, the same workload, in one run.

    scripts/dynamo_env.sh && kvbaton pull smollm2
    python bench/vs_dynamo.py [--concurrency 1,16,64] [--requests 1000] [--repeats 1]

Dynamo is installed CPU-only in a venv of its own: `scripts/dynamo_env.sh` builds
`.venv-dynamo` (`ai-dynamo==1.6.1` with `--no-deps`, then `ai-dynamo-runtime==1.6.1` and its
requirements).

- Workload (the issue's, after aiperf's): streamed chat completions, a user message of `--isl`
  tokens of random words (new words for every request: no prefix cache hits), exactly `--osl`
  output tokens (`ignore_eos`), in a closed loop of C streams (each sends its next request
  when its last one ends), `--requests` per concurrency after C warm-up requests.
- Both stacks: one mocker worker with engine time near zero (`--speedup-ratio 1000`),
  round-robin routing, all on 127.0.0.1; each is started fresh for each repeat, their order
  alternating from repeat to repeat. Every process the benchmark starts is stopped by its PID.
- The client is cheap on purpose (it shares the 2 cores): it scans the SSE bytes for the first
  content and reads the token count from the stream's usage, it does not parse every chunk.
  TTFT is the first chunk with content; ITL is aiperf's: (latency - TTFT) / (tokens - 1).
- Figures per (stack, concurrency): requests/s, TTFT p50/p90, ITL p50, and CPU milliseconds per
  request of each server process (frontend, worker: /proc utime + stime before and after).
- Target (issue 32) at concurrency 64: requests/s at least 1.0x Dynamo's, CPU per request
  (frontend + worker) at most 1.0x.
- `--py-spy DIR`: kvbaton's processes are profiled (py-spy, 100 samples/s) during the run at
  the highest concurrency; the raw stacks go to DIR and each process's top functions by own
  time are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

import headline
from kvbaton.llm.model_files import resolve_model, served_name
from kvbaton.llm.tokenizer import Tokenizer
from serving import (
    STARTUP_S,
    clean_env,
    cpu_by_role,
    free_port,
    loadavg,
    log,
    pct,
    role_of,
    run_benchmark,
    scratch_dir,
    start_serve,
    stop,
)

STACKS = ("dynamo", "kvbaton")
_CONTENT = re.compile(rb'"content":"[^"]')  # a chunk with text (both stacks write compact JSON)
_WORDS = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


@dataclass
class Stack:
    """A running stack: its processes by role, the URL of its frontend and the model's name."""

    procs: dict[str, subprocess.Popen[bytes]]
    url: str
    model: str
    scratch: Path | None = None  # its files (Dynamo's), removed when it stops

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of each process the stack started and their descendants, by role
        (kvbaton's frontend and worker children by theirs)."""
        out: dict[str, float] = {}
        for role, proc in self.procs.items():
            for own, seconds in cpu_by_role(proc.pid, role).items():
                out[own] = out.get(own, 0.0) + seconds
        return out

    def stop(self) -> None:
        for proc in self.procs.values():
            stop(proc)  # type: ignore[arg-type]
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


@dataclass
class Figures:
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float
    cpu_ms: dict[str, float]  # role -> CPU ms per request

    @property
    def cpu_total_ms(self) -> float:
        return sum(self.cpu_ms.values())


# -- starting the stacks -----------------------------------------------------------------------
def dynamo_env(scratch: Path) -> dict[str, str]:
    (scratch / "kv").mkdir()
    (scratch / "home").mkdir()
    (scratch / "tmp").mkdir()
    return {
        **clean_env(),
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(scratch / "kv"),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_SYSTEM_HOST": "127.0.0.1",
        "DYN_HTTP_HOST": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HOME": str(scratch / "home"),  # it caches model cards under ~/.cache/dynamo
        "TMPDIR": str(scratch / "tmp"),  # it writes a logging config per process, never removed
    }


def dynamo_model_dir(model_dir: Path, scratch: Path) -> Path:
    """The model's files for Dynamo: its config must name an architecture (no weights needed)."""
    out = scratch / "model"
    out.mkdir()
    for path in model_dir.iterdir():
        if path.suffix in (".json", ".jinja") and path.name != "config.json":
            (out / path.name).symlink_to(path)
    config = json.loads((model_dir / "config.json").read_text())
    config.setdefault("architectures", ["LlamaForCausalLM"])
    (out / "config.json").write_text(json.dumps(config))
    return out


def launch_dynamo(args: argparse.Namespace, model_dir: Path, name: str) -> Stack:
    """Dynamo's mocker and frontend, started."""
    scratch = Path(tempfile.mkdtemp(prefix="dynamo-bench-"))
    env = dynamo_env(scratch)
    model_dir = dynamo_model_dir(model_dir, scratch)
    port = free_port()
    commands = {
        "worker": [
            "dynamo.mocker", "--model-path", str(model_dir), "--model-name", name,
            "--speedup-ratio", str(args.speedup_ratio), "--num-workers", "1",
        ],
        "frontend": [
            "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
            "--router-mode", "round-robin",
        ],
    }  # fmt: skip
    stack = Stack({}, f"http://127.0.0.1:{port}", name, scratch)
    for role, command in commands.items():
        with (scratch / f"{role}.log").open("wb") as out:
            stack.procs[role] = subprocess.Popen(
                [args.dynamo_python, "-m", *command],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )
    return stack


async def start_dynamo(args: argparse.Namespace, model_dir: Path, name: str) -> Stack:
    """`launch_dynamo`, once it answers."""
    stack = launch_dynamo(args, model_dir, name)
    try:
        await wait_until_answering(stack)
    except BaseException:
        assert stack.scratch is not None
        logs = stack.scratch.glob("*.log")
        tails = "\n".join(p.read_text(errors="replace")[-2000:] for p in logs)
        stack.stop()
        raise RuntimeError(f"Dynamo did not start; its output ends:\n{tails}") from None
    return stack


async def start_kvbaton(args: argparse.Namespace, model_dir: Path, name: str) -> Stack:
    discovery = f"file://{scratch_dir('kvbaton-bench-')}"
    serve = start_serve(
        discovery, "--engine", "mocker", "--model", args.model, "--workers", "1",
        "--speedup-ratio", str(args.speedup_ratio), "--router-mode", "round-robin",
        "--log-level", "WARNING",
    )  # fmt: skip
    stack = Stack({"serve": serve.proc}, serve.url, name)
    try:
        await wait_until_answering(stack)
    except BaseException:
        stack.stop()
        raise
    return stack


async def wait_until_answering(stack: Stack) -> None:
    """Until /v1/models lists the model and a 1-token chat answers."""
    deadline = time.monotonic() + STARTUP_S
    body = {"model": stack.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with httpx.AsyncClient(timeout=10.0) as client:
        while True:
            try:
                models = (await client.get(f"{stack.url}/v1/models")).json()
                if any(m["id"] == stack.model for m in models.get("data", [])):
                    answer = await client.post(f"{stack.url}/v1/chat/completions", json=body)
                    if answer.status_code == 200:
                        return
            except (httpx.HTTPError, ValueError):
                pass
            if any(p.poll() is not None for p in stack.procs.values()):
                raise RuntimeError("a process of the stack exited")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no answer within {STARTUP_S:.0f}s")
            await asyncio.sleep(0.5)


# -- the workload ------------------------------------------------------------------------------
def user_messages(tokenizer: Tokenizer, rng: random.Random, count: int, isl: int) -> list[str]:
    """`count` texts of random words, each exactly `isl` tokens (cut at a token boundary)."""
    texts = []
    for _ in range(count):
        words = " ".join(rng.choice(_WORDS) + rng.choice(_WORDS) for _ in range(isl))
        texts.append(tokenizer.decode(tokenizer.encode(words, add_special_tokens=False)[:isl]))
    return texts


@dataclass
class Sample:
    ttft: float
    latency: float
    tokens: int


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> Sample:
    sent = time.perf_counter()
    first = 0.0
    tail = b""
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())!r}")
        async for piece in response.aiter_raw():
            if not first and _CONTENT.search(piece):
                first = time.perf_counter()
            tail = (tail + piece)[-4096:]
    latency = time.perf_counter() - sent
    usage = next(
        json.loads(line[6:])["usage"]
        for line in reversed(tail.decode(errors="replace").splitlines())
        if line.startswith("data: {") and '"usage":{' in line
    )
    return Sample(first - sent, latency, int(usage["completion_tokens"]))


async def closed_loop(
    stack: Stack, texts: list[str], concurrency: int, osl: int
) -> tuple[list[Sample], float]:
    """Each of `concurrency` streams sends its next request when its last one ends; the samples
    and the wall time from the first request to the last answer."""
    todo = list(texts)
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:

        async def stream() -> None:
            while todo:
                body = {
                    "model": stack.model, "messages": [{"role": "user", "content": todo.pop()}],
                    "max_tokens": osl, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True},
                }  # fmt: skip
                sample = await one_request(client, stack.url, body)
                if sample.tokens != osl:
                    raise RuntimeError(f"{sample.tokens} output tokens, not {osl}")
                samples.append(sample)

        t0 = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(concurrency)))
        return samples, time.perf_counter() - t0


async def measure(
    stack: Stack, kind: str, args: argparse.Namespace, tokenizer: Tokenizer, rng: random.Random
) -> dict[int, Figures]:
    out = {}
    for c in args.concurrency:
        requests = args.requests if c > 1 else min(args.requests, args.requests_at_1)
        await closed_loop(stack, user_messages(tokenizer, rng, c, args.isl), c, args.osl)  # warm
        texts = user_messages(tokenizer, rng, requests, args.isl)
        profiling = args.py_spy and kind == "kvbaton" and c == max(args.concurrency)
        profiles = start_profiles(stack, Path(args.py_spy)) if profiling else []
        cpu0 = stack.cpu_seconds()
        samples, wall = await closed_loop(stack, texts, c, args.osl)
        cpu1 = stack.cpu_seconds()
        for path in stop_profiles(profiles):
            print_profile(path)
        out[c] = Figures(
            requests_per_s=len(samples) / wall,
            ttft_p50_ms=pct([s.ttft for s in samples], 0.5) * 1e3,
            ttft_p90_ms=pct([s.ttft for s in samples], 0.9) * 1e3,
            itl_p50_ms=pct([(s.latency - s.ttft) / (s.tokens - 1) for s in samples], 0.5) * 1e3,
            cpu_ms={r: (cpu1[r] - cpu0.get(r, 0.0)) / len(samples) * 1e3 for r in cpu1},
        )
        f = out[c]
        log(
            f"  c={c}: {f.requests_per_s:.1f} requests/s, TTFT p50 {f.ttft_p50_ms:.1f} ms, "
            f"CPU {f.cpu_total_ms:.2f} ms/request (load {loadavg()})"
        )
    return out


# -- profiles ----------------------------------------------------------------------------------
def start_profiles(stack: Stack, out_dir: Path) -> list[tuple[subprocess.Popen[bytes], Path]]:
    """py-spy recording each process of the stack and its children, raw stacks to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    profiles = []
    for role, proc in stack.procs.items():
        path = out_dir / f"{role}.txt"
        command = [
            "py-spy", "record", "--pid", str(proc.pid), "--subprocesses", "--gil", "--rate", "100",
            "--format", "raw", "--output", str(path),
        ]  # fmt: skip
        recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        profiles.append((recorder, path))
    return profiles


def stop_profiles(profiles: list[tuple[subprocess.Popen[bytes], Path]]) -> list[Path]:
    for recorder, _ in profiles:
        stop(recorder)  # type: ignore[arg-type]  # py-spy writes its file on SIGINT
    return [path for _, path in profiles if path.exists()]


def print_profile(path: Path, top: int = 12) -> None:
    """Each process's functions by own time (the samples' innermost frame), then by the
    innermost kvbaton function (library time counted where kvbaton called it)."""
    own: dict[str, dict[str, int]] = {}
    ours: dict[str, dict[str, int]] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")  # process, its children, ..., thread, outermost frame first
        process = next((f for f in reversed(frames) if f.startswith("process ")), "process")
        caller = next((f for f in reversed(frames) if "kvbaton/" in f), "(no kvbaton frame)")
        for table, frame in ((own, frames[-1]), (ours, caller)):
            name = re.sub(r":\d+\)$", ")", frame)  # one entry per function, not per line
            table.setdefault(process, {})
            table[process][name] = table[process].get(name, 0) + int(count)
    for process in own:
        total = sum(own[process].values())
        pid = re.match(r"process (\d+)", process)
        role = (role_of(int(pid.group(1))) if pid else None) or process[:100]
        for title, table in (("own time", own), ("innermost kvbaton function", ours)):
            print(f"\n{role} ({path.name}), {total} samples, by {title}:\n")
            for name, n in sorted(table[process].items(), key=lambda kv: -kv[1])[:top]:
                print(f"- {n / total:5.1%} {name[:140]}")


# -- the report --------------------------------------------------------------------------------
def cpu_text(f: Figures) -> str:
    parts = " + ".join(f"{role} {ms:.2f}" for role, ms in sorted(f.cpu_ms.items()))
    return f"{f.cpu_total_ms:.2f} ({parts})"


def report(runs: list[dict[str, dict[int, Figures]]], args: argparse.Namespace) -> None:
    print(
        f"\nStreamed chat, ISL {args.isl} / OSL {args.osl}, {args.requests} requests per "
        f"concurrency ({args.requests_at_1} at 1), one mocker worker (speedup "
        f"{args.speedup_ratio:g}), round robin; {len(runs)} repeat(s).\n"
    )
    print(
        "| repeat | concurrency | stack | requests/s | TTFT p50 ms | TTFT p90 ms | ITL p50 ms "
        "| CPU ms/request |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---|")
    for i, run in enumerate(runs, 1):
        for c in args.concurrency:
            for stack in args.stacks:
                f = run[stack][c]
                print(
                    f"| {i} | {c} | {stack} | {f.requests_per_s:.1f} | {f.ttft_p50_ms:.2f} "
                    f"| {f.ttft_p90_ms:.2f} | {f.itl_p50_ms:.3f} | {cpu_text(f)} |"
                )
    if len(args.stacks) < 2:
        return
    print()
    for c in args.concurrency:

        def ratio(key: str, c: int = c) -> float:
            return statistics.median(
                getattr(r["kvbaton"][c], key) / getattr(r["dynamo"][c], key) for r in runs
            )

        print(
            f"c={c}: kvbaton/Dynamo requests/s {ratio('requests_per_s'):.2f}x, TTFT p50 "
            f"{ratio('ttft_p50_ms'):.2f}x, CPU per request {ratio('cpu_total_ms'):.2f}x"
            + (" (targets: >= 1.0x and <= 1.0x)" if c == max(args.concurrency) else "")
        )
    report_headlines(runs, max(args.concurrency))


def report_headlines(runs: list[dict[str, dict[int, Figures]]], c: int) -> None:
    """Requests/s and CPU per request at the top concurrency: medians over the repeats."""

    def median(stack: str, key: str) -> float:
        return statistics.median(getattr(r[stack][c], key) for r in runs)

    for key, what, unit, judge, bound in (
        ("requests_per_s", "requests/s", "", headline.at_least, 1.0),
        ("cpu_total_ms", "CPU per request", " ms", headline.at_most, 1.0),
    ):
        ours, theirs = median("kvbaton", key), median("dynamo", key)
        target, met = judge(ours / theirs, bound)
        headline.report(
            "vs_dynamo",
            f"kvbaton c{c} {what} {ours:,.2f}{unit}",
            f"Dynamo 1.6.1 {theirs:,.2f}{unit}",
            ratio=ours / theirs,
            target=target,
            met=met,
        )


async def run(args: argparse.Namespace) -> int:
    model_dir = resolve_model(args.model)
    name = served_name(args.model)
    tokenizer = Tokenizer(model_dir)
    rng = random.Random(args.seed)
    runs: list[dict[str, dict[int, Figures]]] = []
    for rep in range(args.repeats):
        order = args.stacks if rep % 2 == 0 else args.stacks[::-1]
        figures: dict[str, dict[int, Figures]] = {}
        for kind in order:
            log(f"repeat {rep + 1}/{args.repeats}: starting {kind}")
            start = start_dynamo if kind == "dynamo" else start_kvbaton
            stack = await start(args, model_dir, name)
            try:
                figures[kind] = await measure(stack, kind, args, tokenizer, rng)
            finally:
                stack.stop()
        runs.append(figures)
    report(runs, args)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dynamo-python",
        default=os.environ.get("DYNAMO_PYTHON", ".venv-dynamo/bin/python"),
        help="the Python of Dynamo's venv (default: $DYNAMO_PYTHON, else .venv-dynamo/bin/python)",
    )
    parser.add_argument("--model", default="smollm2", help="whose tokenizer and template")
    parser.add_argument(
        "--stacks", type=lambda s: s.split(","), default=list(STACKS), help="dynamo,kvbaton"
    )
    parser.add_argument("--py-spy", metavar="DIR", help="profile kvbaton at the top concurrency")
    parser.add_argument(
        "--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 16, 64]
    )
    parser.add_argument("--requests", type=int, default=1000, help="per concurrency")
    parser.add_argument("--requests-at-1", type=int, default=200, help="at concurrency 1")
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--speedup-ratio", type=float, default=1000.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if "dynamo" in args.stacks and not Path(args.dynamo_python).exists():
        parser.error(f"no Python at {args.dynamo_python}: scripts/dynamo_env.sh installs Dynamo")
    run_benchmark(run, args)


if __name__ == "__main__":
    main()
