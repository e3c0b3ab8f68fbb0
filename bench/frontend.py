"""Frontend benchmark: what the OpenAI frontend adds on top of calling the worker directly.

    python bench/frontend.py [--requests 2000] [--duration 3] [--trials 3] [--model smollm2]

One worker process with the zero-cost engine (`kvbaton worker --engine fixed`: every request
gets one fixed token at once) and one frontend process (`kvbaton frontend`). The benchmark
process then sends one-token chat completions (non-streaming, `max_tokens: 1`):
- frontend: HTTP POST /v1/chat/completions to the frontend over keep-alive connections (one per
            concurrent caller; a minimal HTTP/1.1 client so that the load generator costs little);
- direct:   the same worker's `generate` endpoint over the request plane with the request already
            templated and tokenized (what the frontend sends it).
At concurrency 1: per-request latency (p50, p90), `--requests` requests per trial. At
concurrency 64: requests/s over `--duration` seconds. Each figure is the median over trials;
added latency is frontend p50 minus direct p50 of the same trial.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from headline import report
from kvbaton.llm.model_files import KNOWN_MODELS, pull, resolve_model, served_name
from kvbaton.llm.tokenizer import Tokenizer
from kvbaton.protocols.llm import EngineOutput, PreprocessedRequest, SamplingParams
from kvbaton.runtime import DistributedRuntime

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
NAMESPACE = "benchfe"
STARTUP_S = 120.0


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "kvbaton", *args], env=env, stdout=out, stderr=out
        )


def frontend_url(log: Path, proc: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if m := re.search(r"OpenAI API at (http://\S+)/v1", log.read_text()):
            return m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError("the frontend did not start:\n" + log.read_text())


class HttpConnection:
    """One keep-alive HTTP/1.1 connection that POSTs a fixed body and reads whole responses."""

    def __init__(self, host: str, port: int, path: str, body: bytes) -> None:
        self.host, self.port = host, port
        self.request = (
            f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode() + body

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def call(self) -> bytes:
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = head[9:12]
        length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE).group(1))  # type: ignore[union-attr]
        body = await self.reader.readexactly(length)
        if status != b"200":
            raise RuntimeError(f"HTTP {status.decode()}: {body.decode()}")
        return body

    def close(self) -> None:
        self.writer.close()


async def latencies(call: Callable[[], Awaitable[object]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t0)
    return out


async def throughput(calls: list[Callable[[], Awaitable[object]]], duration: float) -> float:
    done = 0
    stop = time.perf_counter() + duration

    async def loop(call: Callable[[], Awaitable[object]]) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await call()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(c) for c in calls))
    return done / (time.perf_counter() - t0)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(args: argparse.Namespace) -> None:
    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer(model_dir)
    token = tokenizer.encode("Paris", add_special_tokens=False)[0]
    tmp = Path(tempfile.mkdtemp(prefix="kvbaton-bench-fe-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBATON_")}
    env["KVBATON_DISCOVERY"] = f"file://{tmp / 'discovery'}"
    common = ["--namespace", NAMESPACE, "--log-level", "WARNING"]
    worker = start(
        [
            "worker",
            "--engine",
            "fixed",
            "--model",
            args.model,
            "--fixed-tokens",
            str(token),
            *common,
        ],
        env,
        tmp / "worker.log",
    )
    frontend = start(
        ["frontend", "--http-port", "0", *common[:2], "--log-level", "INFO"], env, tmp / "fe.log"
    )
    name = served_name(args.model)
    body = msgspec.json.encode({"model": name, "messages": MESSAGES, "max_tokens": 1})
    direct_request = PreprocessedRequest(
        model=name,
        token_ids=tokenizer.apply_chat_template(MESSAGES),
        sampling=SamplingParams(max_tokens=1),
    )
    try:
        url = await asyncio.to_thread(frontend_url, tmp / "fe.log", frontend)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        conns = [HttpConnection(host, int(port), "/v1/chat/completions", body) for _ in range(64)]
        async with DistributedRuntime(env["KVBATON_DISCOVERY"]) as runtime:
            client = await runtime.endpoint(f"{NAMESPACE}.backend.generate").client(
                response_type=EngineOutput
            )
            await client.wait_for_instances(STARTUP_S)

            async def direct() -> None:
                async for _ in client.round_robin(direct_request):
                    pass

            print("waiting for the frontend to serve the model...", file=sys.stderr, flush=True)
            for c in conns:
                await c.open()
            deadline = time.monotonic() + STARTUP_S
            while True:
                try:
                    await conns[0].call()
                    break
                except RuntimeError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
            rows: dict[str, list[list[float]]] = {k: [] for k in ("fe1", "d1", "fe64", "d64")}
            for trial in range(args.trials):
                print(f"trial {trial + 1}/{args.trials}", file=sys.stderr, flush=True)
                await latencies(conns[0].call, 200)  # warm-up
                rows["fe1"].append(await latencies(conns[0].call, args.requests))
                rows["d1"].append(await latencies(direct, args.requests))
                rows["fe64"].append([await throughput([c.call for c in conns], args.duration)])
                rows["d64"].append([await throughput([direct] * 64, args.duration)])
            for c in conns:
                c.close()
    finally:
        for proc in (frontend, worker):
            proc.send_signal(signal.SIGINT)
        for proc in (frontend, worker):
            proc.wait(30)
    shutil.rmtree(tmp, ignore_errors=True)  # the logs stay where it failed

    def med(key: str, f: Callable[[list[float]], float]) -> float:
        return statistics.median(f(trial) for trial in rows[key])

    added = statistics.median(
        pct(fe, 0.5) - pct(d, 0.5) for fe, d in zip(rows["fe1"], rows["d1"], strict=True)
    )
    print(f"\nOne-token chat completions, {args.trials} trials, medians. Model {name}.\n")
    print("| concurrency | path | requests/s | p50 ms | p90 ms |")
    print("|---:|---|---:|---:|---:|")
    for key, label in (("fe1", "frontend (HTTP)"), ("d1", "direct (request plane)")):
        rps = med(key, lambda t: len(t) / sum(t))
        print(
            f"| 1 | {label} | {rps:,.0f} | {med(key, lambda t: pct(t, 0.5)) * 1e3:.3f} | "
            f"{med(key, lambda t: pct(t, 0.9)) * 1e3:.3f} |"
        )
    for key, label in (("fe64", "frontend (HTTP)"), ("d64", "direct (request plane)")):
        print(f"| 64 | {label} | {med(key, lambda t: t[0]):,.0f} | | |")
    print(f"\nadded latency at p50, concurrency 1: {added * 1e3:.3f} ms (target < 1 ms)")
    fe64 = med("fe64", lambda t: t[0])
    print(f"frontend requests/s at concurrency 64: {fe64:,.0f} (target >= 1,000)")
    print()
    fe1, d1 = med("fe1", lambda t: pct(t, 0.5)), med("d1", lambda t: pct(t, 0.5))
    report(
        "frontend",
        f"c1 p50 {fe1 * 1e3:.3f} ms, {added * 1e3:+.3f} ms added",
        f"direct {d1 * 1e3:.3f} ms",
        ratio=fe1 / d1,
        target="under 1 ms added",
        met=added < 1e-3,
    )
    d64 = med("d64", lambda t: t[0])
    report(
        "frontend",
        f"c64 {fe64:,.0f} req/s",
        f"direct {d64:,.0f} req/s",
        ratio=fe64 / d64,
        target="at least 1,000 req/s",
        met=fe64 >= 1000,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--model", default="smollm2", help="whose tokenizer to use")
    args = parser.parse_args()
    if args.model in KNOWN_MODELS:  # pulled once, then only looked at
        pull(args.model, progress=lambda line: print(line, file=sys.stderr, flush=True))
    try:
        import uvloop

        uvloop.run(run(args))
    except ImportError:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
