"""What the benchmarks that drive a real `kvbaton serve` (or a frontend and workers) share:
progress lines, percentiles, starting a frontend and waiting for its workers, stopping a
deployment, and reading an OpenAI SSE stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvbaton.llm.model_files import KNOWN_MODELS, pull

STARTUP_S = 180.0  # a frontend's start, or its workers' registration, at most
_LISTENING = re.compile(r"OpenAI API at (http://\S+)/v1")
_READY = re.compile(r"ready at (http://\S+)/v1")  # kvbaton serve's


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGINT, as Ctrl-C would; killed after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def sse_chunks(response: httpx.Response) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """The JSON chunks of an OpenAI SSE stream, each with the time it arrived; an error event
    raises."""
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        now = time.perf_counter()
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        yield now, chunk


def clean_env() -> dict[str, str]:
    """This environment without KVBATON_* variables (the benchmark sets what it needs)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVBATON_")}


@dataclass
class Frontend:
    proc: subprocess.Popen[bytes]
    url: str = ""
    lines: list[str] = field(default_factory=list)  # its last lines of output


def start_frontend(discovery: str, namespace: str, *extra: str) -> Frontend:
    """`kvbaton frontend` on a free port; returns once it listens."""
    command = ["frontend", "--namespace", namespace, "--http-port", "0", "--discovery", discovery]
    return _start([*command, *extra], _LISTENING)


def start_serve(discovery: str, *flags: str, env: dict[str, str] | None = None) -> Frontend:
    """`kvbaton serve` on a free port; returns once it says its model is ready (`url`: its
    frontend's). `env`: variables added to its environment."""
    command = ["serve", "--http-port", "0", "--discovery", discovery, *flags]
    return _start(command, _READY, env)


def _start(
    command: list[str], ready_line: re.Pattern[str], env: dict[str, str] | None = None
) -> Frontend:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbaton", *command],
        env={**clean_env(), **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    frontend = Frontend(proc)
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            frontend.lines = [*frontend.lines[-50:], line]
            if not ready.is_set() and (m := ready_line.search(line)):
                frontend.url = m.group(1)
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + STARTUP_S
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)  # type: ignore[arg-type]
            raise RuntimeError(f"kvbaton {command[0]} did not start:\n" + "\n".join(frontend.lines))
    return frontend


async def wait_for_workers(url: str, prefill: int, decode: int, timeout: float) -> str:
    """The model's name once the frontend lists `prefill` + `decode` live workers."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                health = (await client.get(f"{url}/health")).json()
                for name, workers in health.get("models", {}).items():
                    live_prefill = health.get("prefill", {}).get(name, [])
                    if len(workers) >= decode and len(live_prefill) >= prefill:
                        return str(name)
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers did not register within {timeout:.0f}s")
            await asyncio.sleep(0.3)


def run_benchmark(run: Callable[[Any], Coroutine[Any, Any, int]], args: Any) -> None:
    """Pull `args.model` if it is a known one, run `run(args)` and exit with its code (130 on
    Ctrl-C)."""
    if args.model in KNOWN_MODELS:
        pull(args.model, progress=log)
    try:
        sys.exit(asyncio.run(run(args)))
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(130)
