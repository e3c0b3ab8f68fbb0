"""What the benchmarks that drive a real `kvbaton serve` (or a frontend and workers) share:
progress lines, percentiles, starting a frontend and waiting for its workers, stopping a
deployment, and reading an OpenAI SSE stream."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvbaton.llm.model_files import KNOWN_MODELS, pull
from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import DistributedRuntime

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


def scratch_dir(prefix: str) -> Path:
    """A new temporary directory, removed when the benchmark's process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def clean_env() -> dict[str, str]:
    """This environment without KVBATON_* variables (the benchmark sets what it needs), and with
    engines that run every step eagerly: a worker's default builds its compiled decode in the
    background the first time (minutes of CPU beside the measurement), and a benchmark's figures
    should not depend on whether that happened. bench/engine.py measures the compiled decode,
    and bench/vs_vllm.py serve's default once it runs compiled."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBATON_")}
    env["KVBATON_COMPILE"] = "none"
    return env


def vllm_env() -> dict[str, str]:
    """`clean_env()` for a vLLM process, its ipc sockets in a scratch directory: vLLM leaves
    them behind, even when it ends normally."""
    return clean_env() | {"VLLM_RPC_BASE_PATH": str(scratch_dir("vllm-ipc-"))}


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


async def worker_load(discovery: str) -> WorkerLoad:
    """The `load_metrics` answer of a worker of `kvbaton serve` (its `backend` component)."""
    async with DistributedRuntime(discovery) as runtime:
        client = await runtime.endpoint("kvbaton.backend.load_metrics").client(
            response_type=WorkerLoad
        )
        try:
            await client.wait_for_instances(STARTUP_S)
            return await anext(client.round_robin(None))  # type: ignore[no-any-return]
        finally:
            await client.close()


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


# -- measuring: CPU seconds from /proc, a closed loop of streamed completions ----------------
TICK = os.sysconf("SC_CLK_TCK")


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def machine_seconds() -> dict[str, float]:
    """CPU seconds since boot: all processes' (`all`: user, nice, system, irq, softirq), and
    what the hypervisor gave other machines while this one wanted to run (`steal`)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6]
    return {"all": busy / TICK, "steal": fields[7] / TICK}


def process_seconds(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(stat[11]) + int(stat[12])) / TICK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cpu_by_role(root: int, root_role: str) -> dict[str, float]:
    """CPU seconds so far of `root` (as `root_role`) and of each descendant, by role."""
    out = {root_role: process_seconds(root)}
    for pid in descendants(root):
        if (role := role_of(pid, unknown="other")) is not None:
            out[role] = out.get(role, 0.0) + process_seconds(pid)
    return out


def descendants(pid: int) -> list[int]:
    """The process's children (started by any of its threads), theirs, and so on."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            children += [int(c) for c in (task / "children").read_text().split()]
    return [c for child in children for c in (child, *descendants(child))]


def role_of(pid: int, unknown: str | None = None) -> str | None:
    """A process's role from its command line: vLLM's own names (VLLM::EngineCore, ...), the
    vLLM reaper, kvbaton's frontend and worker; `unknown` for any other; None if it is gone."""
    try:
        words = [w.decode() for w in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    except OSError:
        return None
    if words[0].startswith("VLLM::"):
        return words[0].removeprefix("VLLM::")
    if any(w.endswith("vllm_reaper.py") for w in words):
        return "reaper"
    for role in ("frontend", "worker"):
        if role in words:
            return role
    return unknown


@dataclass
class Request:
    sent: float = 0.0
    first: float = 0.0
    last: float = 0.0
    tokens: int = 0


async def serve_run(
    url: str, model: str, batch: list[list[int]], concurrency: int, tokens: int
) -> list[Request]:
    """Closed loop over HTTP: `concurrency` streams, each sending its next request as one ends."""
    todo = list(batch)
    done: list[Request] = []
    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:

        async def stream() -> None:
            while todo:
                prompt = todo.pop(0)
                body: dict[str, Any] = {
                    "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                }  # fmt: skip
                r = Request(sent=time.perf_counter())
                async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        error = await response.aread()
                        raise RuntimeError(f"HTTP {response.status_code}: {error!r}")
                    async for now, chunk in sse_chunks(response):
                        if chunk["choices"] and chunk["choices"][0].get("text"):
                            r.first = r.first or now
                            r.last = now
                        if chunk.get("usage"):
                            r.tokens = chunk["usage"]["completion_tokens"]
                if r.tokens != tokens:
                    raise RuntimeError(f"{r.tokens} output tokens, not {tokens}")
                done.append(r)

        await asyncio.gather(*(stream() for _ in range(concurrency)))
    return done
