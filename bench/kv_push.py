"""Decode-first handoff: what writing a prompt's KV layer by layer, as the prefill worker computes
it, saves against writing whole blocks once the prompt is computed.

    python bench/kv_push.py [--backends shm tcp] [--lengths 512 2048] [--prompts 5] [--trials 2]

For each backend, `kvbaton serve --mode disagg --transfer-order decode-first --engine torch
--kv-transfer BACKEND` (1 prefill + 1 decode worker) is started with `--kv-push layers` and,
the baseline, with `--kv-push blocks`, in the order layers, blocks, blocks, layers, ... (`--trials`
deployments of each), and each deployment is sent the same prompts one at a time: `--prompts`
of each of `--lengths` tokens (random token ids, no two sharing a block: no prefix-cache hits),
streamed, 2 output tokens.

Figures (medians over every prompt of a length, all trials):
- handoff wait: how long the request waited on the KV writes once the prefill worker's forward
  pass had ended (the prefill worker's `load_metrics`, `kv_handoff_wait_seconds`, read before
  and after each request): the part of the transfer that the time to first token pays;
- TTFT: at the response's first SSE event (decode-first: the decode worker streams the first
  token once the KV is in its blocks). It includes the prefill itself, whose noise on a shared
  machine can be larger than the handoff.

Checks (the run fails otherwise): every request's KV moved from the prefill worker (one handoff
each), every answer has its 2 tokens, and both modes answer each prompt with the same text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import httpx

from headline import report
from kvbaton.llm.model_files import resolve_model, served_name
from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import Client, DistributedRuntime
from serving import clean_env, log, run_benchmark, sse_chunks, stop

MODES = ("layers", "blocks")
BACKENDS = ("shm", "tcp", "nixl")
STARTUP_S = 180.0
REQUEST_TIMEOUT_S = 300.0
_FIRST_TOKEN_ID = 256  # prompts avoid special and byte tokens


@dataclass
class Sample:
    backend: str
    mode: str
    index: int  # the prompt's, in the batch every deployment is sent
    length: int
    ttft: float
    wait: float
    text: str


def prompts(lengths: list[int], count: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    low = min(_FIRST_TOKEN_ID, vocab_size // 2)
    return [
        [rng.randrange(low, vocab_size) for _ in range(n)] for n in lengths for _ in range(count)
    ]


def start(
    args: argparse.Namespace, backend: str, mode: str, discovery: str
) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "kvbaton", "serve", "--engine", "torch", "--model", args.model,
        "--http-port", "0", "--discovery", discovery, "--mode", "disagg", "--transfer-order",
        "decode-first", "--kv-transfer", backend, "--kv-push", mode, "--log-level", "WARNING",
    ]  # fmt: skip
    if args.max_model_len:
        command += ["--max-model-len", str(args.max_model_len)]
    return subprocess.Popen(
        command, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )


def ready_url(proc: subprocess.Popen[str]) -> str | None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if "ready at " in line:
            return line.split("ready at ", 1)[1].split()[0].removesuffix("/v1")
    return None


async def load(client: Client) -> WorkerLoad:
    loads: list[WorkerLoad] = [x async for x in client.round_robin(None)]
    return loads[0]


async def ask(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int]
) -> tuple[float, str]:
    """(TTFT, text) of one streamed request."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.perf_counter()
    ttft, text, tokens = 0.0, "", 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())!r}")
        async for now, chunk in sse_chunks(response):
            ttft = ttft or now - started
            if chunk["choices"]:
                text += chunk["choices"][0].get("text", "")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if tokens != 2:
        raise RuntimeError(f"{tokens} output tokens, not 2")
    return ttft, text


async def one_deployment(
    args: argparse.Namespace, backend: str, mode: str, batch: list[list[int]]
) -> list[Sample]:
    model = served_name(args.model)
    with tempfile.TemporaryDirectory(prefix="kvbaton-bench-push-") as tmp:
        proc = start(args, backend, mode, f"file://{tmp}")
        try:
            url = await asyncio.wait_for(asyncio.to_thread(ready_url, proc), STARTUP_S)
            if url is None:
                raise RuntimeError(f"kvbaton serve ({backend}, {mode}) exited before it was ready")
            samples = []
            async with (
                httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client,
                DistributedRuntime(f"file://{tmp}") as runtime,
            ):
                prefill = await runtime.endpoint("kvbaton.prefill.load_metrics").client(
                    response_type=WorkerLoad
                )
                await prefill.wait_for_instances(STARTUP_S)
                warm_up = [_FIRST_TOKEN_ID + i for i in range(64)]  # shares no block with batch
                await ask(client, url, model, warm_up)  # connections, the first steps
                for index, prompt in enumerate(batch):
                    before = await load(prefill)
                    ttft, text = await ask(client, url, model, prompt)
                    after = await load(prefill)
                    if after.kv_handoffs - before.kv_handoffs != 1:
                        raise RuntimeError(f"a {len(prompt)}-token prompt's KV was not pushed")
                    wait = after.kv_handoff_wait_seconds - before.kv_handoff_wait_seconds
                    samples.append(Sample(backend, mode, index, len(prompt), ttft, wait, text))
                await prefill.close()
            log(
                f"  {backend}, {mode}: handoff wait p50 "
                f"{statistics.median(s.wait for s in samples) * 1e3:.1f} ms"
            )
            return samples
        finally:
            await asyncio.to_thread(stop, proc)


async def run(args: argparse.Namespace) -> int:
    vocab = int(json.loads((resolve_model(args.model) / "config.json").read_text())["vocab_size"])
    batch = prompts(args.lengths, args.prompts, vocab)
    samples: list[Sample] = []
    for backend in args.backends:
        order = [MODES[(t + k) % 2] for t in range(args.trials) for k in (0, 1)]
        for i, mode in enumerate(order):
            log(f"{backend}: deployment {i + 1}/{len(order)}, --kv-push {mode}...")
            samples += await one_deployment(args, backend, mode, batch)
    answers: dict[tuple[str, int], set[str]] = {}
    for s in samples:
        answers.setdefault((s.backend, s.index), set()).add(s.text)
    if any(len(texts) != 1 for texts in answers.values()):
        raise RuntimeError("the modes answered a prompt differently (greedy)")
    print(
        f"\nDecode-first, {args.model} on the built-in engine: {args.prompts} prompts per length, "
        f"{args.trials} deployment(s) per mode and backend; medians. Times in ms.\n"
    )
    print(
        "| backend | prompt tokens | handoff wait, layers | handoff wait, blocks | layers / blocks "
        "| TTFT, layers | TTFT, blocks | layers / blocks |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for backend in args.backends:
        for length in args.lengths:

            def med(mode: str, key: str, backend: str = backend, length: int = length) -> float:
                return statistics.median(
                    getattr(s, key)
                    for s in samples
                    if (s.backend, s.mode, s.length) == (backend, mode, length)
                )

            wait = [med(m, "wait") for m in MODES]
            ttft = [med(m, "ttft") for m in MODES]
            print(
                f"| {backend} | {length} | {wait[0] * 1e3:.1f} | {wait[1] * 1e3:.1f} | "
                f"{wait[0] / wait[1]:.2f} | {ttft[0] * 1e3:.0f} | {ttft[1] * 1e3:.0f} | "
                f"{ttft[0] / ttft[1]:.3f} |"
            )
    print()
    longest = max(args.lengths)
    for backend in args.backends:  # the longest prompts' handoff wait: what layers saves
        waits = {
            mode: statistics.median(
                s.wait for s in samples if (s.backend, s.mode, s.length) == (backend, mode, longest)
            )
            for mode in MODES
        }
        layers, blocks = waits["layers"], waits["blocks"]
        report(
            "kv_push",
            f"{backend} {longest:,}-token handoff wait, layers {layers * 1e3:.1f} ms",
            f"blocks {blocks * 1e3:.1f} ms",
            ratio=layers / blocks if blocks else None,
        )
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--backends", nargs="+", default=["shm", "tcp"], choices=BACKENDS)
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--prompts", type=int, default=5, help="prompts of each length")
    parser.add_argument("--trials", type=int, default=2, help="deployments per mode and backend")
    parser.add_argument("--max-model-len", type=int, help="(default: the model's)")
    run_benchmark(run, parser.parse_args())


if __name__ == "__main__":
    main()
