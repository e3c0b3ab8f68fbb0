"""The fault suite: a worker killed (-9) under 50 concurrent streams, with real processes. Each
deployment first serves the 50 requests undisturbed (the reference), then again while one worker
is killed: every request completes with all of its tokens and the same greedy text as in the
reference (its stream migrated when its worker died), and the survivors end with no KV block in
use.

Victims: a worker mid-stream (aggregated; mocker and the tiny real model), a decode worker
mid-stream, and a prefill worker while prefills and KV transfers are in flight (disaggregated,
mocker: the requests it was prefilling are prefilled on the decode worker instead). And a
worker stopped with SIGTERM and a short drain timeout: it deregisters, the
streams it cannot finish in time are migrated, and it exits 0.

The victim is signalled when its own load shows it mid-work, not when the client has read so
many chunks: the client reads behind the workers, by however long its process stalls, and a
victim that finished its streams first would lose nothing."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
from pathlib import Path

import openai
import pytest

from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import DistributedRuntime
from kvbaton.runtime.errors import RuntimeServiceError
from tests.conftest import WorkerFactory, instance_id, worker_log
from tests.frontend.fleet import client_of, model_row, poll, ready, running_frontend
from tests.helpers import scraped

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NS = "t"
STREAMS = 50
MIGRATIONS = "kvbaton_frontend_migrations_total"
PREFILLS = "kvbaton_frontend_disaggregated_prefills_total"
# Tokens a stream: enough that a victim seen mid-stream is still so when the signal reaches it.
# The real model writes a token of 25 streams in ~2 ms: 150 tokens are ~0.3 s; the mocker's
# SLOW_DECODE ~30 ms: 40 tokens are ~1.2 s.
TOKENS = {"mocker": 40, "torch": 150}
PROMPTS = [[(i * 7 + j * 13) % 150 + 20 for j in range(40 + i)] for i in range(STREAMS)]
BLOCK = 16  # tokens a KV block: the mocker's here, the real engine's by default
# The most blocks a prompt and its first token fill.
PROMPT_BLOCKS = -(-(max(map(len, PROMPTS)) + 1) // BLOCK)
MOCKER = ("--block-size", str(BLOCK), "--num-kv-blocks", "1024", "--max-model-len", "1024")
SLOW_DECODE = ("--speedup-ratio", "0.2")  # about 30 ms a token: streams last about a second
SLOW_PREFILL = ("--mocker-prefill", "0,1,0", "--max-num-batched-tokens", "128")  # 1 ms a token


async def one_stream(
    client: openai.AsyncOpenAI,
    model: str,
    prompt: list[int],
    tokens: int,
) -> tuple[str, int]:
    """The request's text and completion tokens (its usage)."""
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text: list[str] = []
    completion = -1
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            completion = chunk.usage.completion_tokens
    return "".join(text), completion


async def serve_all(client: openai.AsyncOpenAI, model: str, tokens: int) -> list[tuple[str, int]]:
    return await asyncio.gather(*(one_stream(client, model, p, tokens) for p in PROMPTS))


async def used_blocks(runtime: DistributedRuntime, component: str) -> dict[int, int]:
    """Blocks in use on each live worker of `component` (a dead one that discovery still lists
    is skipped)."""
    client = await runtime.endpoint(f"{NS}.{component}.load_metrics").client(
        response_type=WorkerLoad
    )
    used: dict[int, int] = {}
    try:
        for instance in client.instance_ids():
            try:
                load: WorkerLoad = await anext(client.direct(None, instance, timeout=5))
            except (RuntimeServiceError, TimeoutError):
                continue
            used[instance] = load.kv_blocks_used
    finally:
        await client.close()
    return used


def loads_said(loads: list[WorkerLoad]) -> str:
    """How many loads were read, and the busiest of them (running, pending prefill, blocks)."""
    if not loads:
        return "no load read"
    top = max(loads, key=lambda load: load.running)
    return (
        f"{len(loads)} loads read; the most running: {top.running} running, "
        f"{top.active_prefill_tokens} prefill tokens pending, {top.kv_blocks_used} blocks used"
    )


def signal_mid_work(
    discovery: str,
    component: str,
    instance: int,
    victim: subprocess.Popen[bytes],
    sig: signal.Signals,
    streams: int,
    stop: threading.Event,
    seen: list[WorkerLoad],
) -> WorkerLoad | None:
    """Send `sig` to `victim` (instance `instance` of `component`) once its load shows it
    mid-work; the load it was signalled at, or None if `stop` was set first. Each load read is
    appended to `seen` (what a victim never seen mid-work did instead). Mid-work: a prefill
    worker has computed prompts (its pending prefill fell) and has more to compute; another runs
    `streams` requests or more, each past its prompt, which have decoded a few tokens since (their
    blocks grew by a quarter of their number: with 16-token blocks, about 4 tokens each). Grew
    from the blocks read once every prompt was computed, or, where no read came before the
    decode was well on, from the most the prompts can hold (`PROMPT_BLOCKS` each).

    Run in a thread, on a runtime of its own: the test's loop, reading 50 streams through the
    client, falls hundreds of ms behind the workers, time in which the victim could finish."""

    async def watch() -> WorkerLoad | None:
        async with DistributedRuntime(discovery) as runtime:
            client = await runtime.endpoint(f"{NS}.{component}.load_metrics").client(
                response_type=WorkerLoad
            )
            peak = 0
            prompts_done: int | None = None  # blocks in use once every prompt was computed
            try:
                while not stop.is_set():
                    load: WorkerLoad = await anext(client.direct(None, instance, timeout=5))
                    seen.append(load)
                    pending, used = load.active_prefill_tokens, load.kv_blocks_used
                    peak = max(peak, pending)
                    if component == "prefill":
                        busy = 0 < pending < peak
                    elif load.running >= streams and pending == 0:
                        prompts_done = used if prompts_done is None else prompts_done
                        decode_from = min(prompts_done, load.running * PROMPT_BLOCKS)
                        busy = used >= decode_from + load.running // 4
                    else:
                        busy = False
                    if busy:
                        victim.send_signal(sig)
                        return load
                    await asyncio.sleep(0.01)
                return None
            finally:
                await client.close()

    return asyncio.run(watch())


async def clear_cache(runtime: DistributedRuntime, component: str, count: int) -> None:
    """Drop the cached blocks of the `count` workers of `component`, so that the next run's
    prefills take as long as the first run's did."""
    client = await runtime.endpoint(f"{NS}.{component}.clear_kv_blocks").client()
    try:

        async def listed() -> bool:
            return len(client.instance_ids()) == count

        await poll(listed, 30, f"{count} {component} workers to clear")
        for instance in client.instance_ids():
            assert "cleared" in await anext(client.direct(None, instance, timeout=10))
    finally:
        await client.close()


SHORT_DRAIN = ("--drain-timeout", "0.3")


SCENARIOS = {
    # name: (workers as (role, engine, extra flags), index of the victim, signal to it)
    "agg-mocker-mid-stream": ([("agg", "mocker", SLOW_DECODE)] * 2, 0, signal.SIGKILL),
    "agg-real-model-mid-stream": ([("agg", "torch", ())] * 2, 0, signal.SIGKILL),
    "decode-worker-mid-stream": (
        [("prefill", "mocker", ()), ("decode", "mocker", SLOW_DECODE), ("decode", "mocker", ())],
        1,
        signal.SIGKILL,
    ),
    "prefill-worker-mid-transfer": (
        [("prefill", "mocker", SLOW_PREFILL)] * 2 + [("decode", "mocker", SLOW_DECODE)],
        0,
        signal.SIGKILL,
    ),
    "agg-mocker-sigterm-short-drain": (
        [("agg", "mocker", SLOW_DECODE + SHORT_DRAIN), ("agg", "mocker", SLOW_DECODE)],
        0,
        signal.SIGTERM,
    ),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
async def test_a_worker_killed_under_50_streams_loses_no_request_and_no_token(
    chat_model: Path, spawn_worker: WorkerFactory, tmp_path: Path, scenario: str
) -> None:
    workers, victim_index, sig = SCENARIOS[scenario]
    async with running_frontend(tmp_path) as frontend:
        procs: list[subprocess.Popen[bytes]] = []
        for role, engine, extra in workers:
            flags = ["--model", str(chat_model), "--role", role, *extra]
            flags += MOCKER if engine == "mocker" else ["--dtype", "float32", "--num-threads", "1"]
            procs.append(spawn_worker(*flags, engine=engine, lease_ttl=3.0, namespace=NS))
        serving = sum(role != "prefill" for role, _, _ in workers)
        await ready(frontend, chat_model, prefill=len(workers) - serving, serving=serving)
        model = chat_model.name
        async with client_of(frontend) as client, DistributedRuntime(frontend.discovery) as rt:
            tokens = max(TOKENS[engine] for _, engine, _ in workers)
            reference = await serve_all(client, model, tokens)
            assert all(n == tokens for _, n in reference), reference
            # Without their cached prefixes the prompts prefill as slowly again: a prefill victim
            # is seen mid-prefill.
            await clear_cache(rt, "backend", serving)
            if len(workers) > serving:
                await clear_cache(rt, "prefill", len(workers) - serving)

            victim = procs[victim_index]
            victim_role = workers[victim_index][0]
            victim_component = "prefill" if victim_role == "prefill" else "backend"
            victim_id = instance_id(worker_log(tmp_path, victim_index))
            half_its_share = STREAMS // serving // 2  # of the streams, on a serving victim
            stop = threading.Event()
            seen: list[WorkerLoad] = []
            killer = asyncio.create_task(
                asyncio.to_thread(
                    signal_mid_work,
                    frontend.discovery,
                    victim_component,
                    victim_id,
                    victim,
                    sig,
                    half_its_share,
                    stop,
                    seen,
                )
            )
            try:
                disturbed = await serve_all(client, model, tokens)
            finally:
                stop.set()
            killed_at = await killer
            assert killed_at is not None, f"the victim was never seen mid-work: {loads_said(seen)}"
            assert victim.wait(10) == (-sig if sig == signal.SIGKILL else 0)
            assert disturbed == reference, killed_at  # every token, once, in order; same text

            components = {"prefill" if role == "prefill" else "backend" for role, _, _ in workers}

            async def survivors_free() -> bool:
                used: dict[int, int] = {}
                for component in components:
                    used |= await used_blocks(rt, component)
                return len(used) == len(workers) - 1 and not any(used.values())

            await poll(survivors_free, 30, "a survivor still holds blocks")
            model_counts = await model_row(frontend)
            exported = {  # the same counts on /metrics
                "migrations": scraped(f"{frontend.url}/metrics", MIGRATIONS),
                "fallbacks": scraped(f"{frontend.url}/metrics", PREFILLS, outcome="fallback"),
            }
        fallbacks = (model_counts["disaggregated"] or {}).get("fallbacks", 0)
        assert exported == {"migrations": model_counts["migrations"], "fallbacks": fallbacks}
        if victim_role == "prefill":  # its requests were prefilled on their decode workers
            assert fallbacks > 0, model_counts
        else:  # its requests went on elsewhere
            assert model_counts["migrations"] > 0, model_counts
