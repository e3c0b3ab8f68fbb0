"""What the benchmarks that drive a real `kvbaton serve` share: progress lines, percentiles,
stopping a deployment, and reading an OpenAI SSE stream."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx


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
