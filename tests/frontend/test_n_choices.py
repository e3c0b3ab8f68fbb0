"""OpenAI's `n` through real deployments and the official `openai` client: `n=3` whole and
`n=2` streamed on chat and completions, per-choice seeds, usage that counts each prompt once,
the limit on `n`; each prompt prefilled once and its KV blocks shared by its choices (the
workers' prefix-cache counts), one KV transfer for every choice when disaggregated; a client
that leaves cancels every choice; a choice whose worker is killed mid-stream migrates (mocker
workers)."""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvbaton.frontend.choices import MAX_CHOICES
from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import DistributedRuntime
from tests.conftest import WorkerFactory, instance_id, worker_log
from tests.frontend.conftest import (
    Deployment,
    start_serve,
    stop_cleanly,
    wait_for_health,
    worker_load,
)
from tests.frontend.fleet import NS, client_of, mocker, poll, ready, running_frontend

pytestmark = pytest.mark.integration

BLOCK = 16  # the engine's block size
PROMPT = [(5 * i) % 200 + 20 for i in range(40)]  # two full blocks and a partial one
OTHER = [(11 * i) % 200 + 20 for i in range(21)]
MESSAGES = [{"role": "user", "content": "Name three colours."}]
BACKEND = "kvbaton.backend.load_metrics"


@pytest.fixture(scope="module")
def agg(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """One aggregated worker; no canaries (they would add to its prefix-cache counts)."""
    deployment = start_serve(
        chat_model, tmp_path_factory.mktemp("discovery"), "--canary-period", "0"
    )
    yield deployment
    stop_cleanly(deployment)


@pytest.fixture(scope="module")
def client(agg: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{agg.url}/v1", api_key="none", max_retries=0)


def fresh() -> dict[str, Any]:
    """A cache salt no other request has: the prompt's blocks are cached nowhere yet."""
    return {"ignore_eos": True, "cache_salt": uuid.uuid4().hex}


@dataclass
class Streamed:
    """A streamed answer, by choice index."""

    texts: dict[int, str] = field(default_factory=dict)
    finishes: dict[int, list[str]] = field(default_factory=dict)  # each chunk's finish reason
    roles: list[int] = field(default_factory=list)  # chat: the indices of role chunks
    usage: Any = None

    def add(self, chunk: Any, chat: bool) -> None:
        if chunk.usage is not None:
            self.usage = chunk.usage
        for choice in chunk.choices:
            i = choice.index
            text = (choice.delta.content or "") if chat else choice.text
            if chat and choice.delta.role:
                self.roles.append(i)
            self.texts[i] = self.texts.get(i, "") + text
            if choice.finish_reason is not None:
                self.finishes.setdefault(i, []).append(choice.finish_reason)


def create(client: openai.OpenAI, route: str, model: str, **fields: Any) -> Any:
    if route == "chat":
        return client.chat.completions.create(model=model, messages=MESSAGES, **fields)  # type: ignore[arg-type]
    return client.completions.create(model=model, prompt=PROMPT, **fields)


def texts(answer: Any) -> list[str]:
    return [c.message.content if hasattr(c, "message") else c.text for c in answer.choices]


def test_n3_whole_on_chat_counts_the_prompt_once(client: openai.OpenAI, agg: Deployment) -> None:
    one = client.chat.completions.create(
        model=agg.model,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        extra_body=fresh(),  # type: ignore[arg-type]
    )
    three = client.chat.completions.create(
        model=agg.model,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        n=3,
        extra_body=fresh(),  # type: ignore[arg-type]
    )
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.finish_reason for c in three.choices] == ["length"] * 3
    assert texts(three) == texts(one) * 3  # greedy: every choice is the one answer
    assert one.usage is not None and three.usage is not None
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # once, not per choice
    assert three.usage.completion_tokens == 3 * 6
    assert three.usage.total_tokens == one.usage.prompt_tokens + 18


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_n2_streamed_carries_each_choice_s_index(
    client: openai.OpenAI, agg: Deployment, route: str
) -> None:
    sampling: dict[str, Any] = {"max_tokens": 10, "temperature": 1.0, "seed": 3, "n": 2}
    whole = create(client, route, agg.model, **sampling, extra_body=fresh())
    streamed = Streamed()
    for chunk in create(
        client,
        route,
        agg.model,
        **sampling,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=fresh(),
    ):
        streamed.add(chunk, route == "chat")
    assert sorted(streamed.texts) == [0, 1]
    assert streamed.finishes == {0: ["length"], 1: ["length"]}  # one end per choice
    if route == "chat":
        assert sorted(streamed.roles) == [0, 1]
    assert [streamed.texts[0], streamed.texts[1]] == texts(whole)
    assert streamed.usage.completion_tokens == whole.usage.completion_tokens == 20
    assert streamed.usage.prompt_tokens == whole.usage.prompt_tokens


def test_each_choice_samples_with_the_seed_plus_its_index(
    client: openai.OpenAI, agg: Deployment
) -> None:
    def sample(n: int, seed: int) -> list[str]:
        answer = client.completions.create(
            model=agg.model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            n=n,
            extra_body={"ignore_eos": True},
        )
        return texts(answer)

    three = sample(3, 11)
    assert len(set(three)) == 3  # the choices differ
    assert sample(3, 11) == three  # and the answer repeats
    assert [sample(1, 11 + i)[0] for i in range(3)] == three  # choice i: seed + i


def test_n_with_several_prompts_indexes_by_prompt_then_choice(
    client: openai.OpenAI, agg: Deployment
) -> None:
    greedy: dict[str, Any] = {"max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    answer = client.completions.create(model=agg.model, prompt=[PROMPT, OTHER], n=2, **greedy)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    first = client.completions.create(model=agg.model, prompt=PROMPT, **greedy)
    second = client.completions.create(model=agg.model, prompt=OTHER, **greedy)
    assert texts(answer) == texts(first) * 2 + texts(second) * 2
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == len(PROMPT) + len(OTHER)
    assert answer.usage.completion_tokens == 4 * 5


def test_n_over_the_limit_is_a_400_naming_n(client: openai.OpenAI, agg: Deployment) -> None:
    for n in (0, MAX_CHOICES + 1):
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=agg.model, messages=MESSAGES, n=n)  # type: ignore[arg-type]
        assert raised.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="best_of must be at least n"):
        client.completions.create(model=agg.model, prompt=PROMPT, n=2, best_of=1)
    most = client.completions.create(model=agg.model, prompt=PROMPT, n=MAX_CHOICES, max_tokens=1)
    assert [c.index for c in most.choices] == list(range(MAX_CHOICES))


async def backend_load(discovery: str) -> WorkerLoad:
    async with DistributedRuntime(discovery) as runtime:
        return await worker_load(runtime, BACKEND)


def test_the_choices_share_the_prompt_s_blocks(client: openai.OpenAI, agg: Deployment) -> None:
    """The prompt is computed once; each later choice computes only its last partial block
    (at least one token is always computed, to sample from)."""
    before = asyncio.run(backend_load(agg.discovery))
    answer = client.completions.create(
        model=agg.model, prompt=PROMPT, n=3, max_tokens=4, temperature=0, extra_body=fresh()
    )
    after = asyncio.run(backend_load(agg.discovery))
    queried = after.prefix_cache_queries - before.prefix_cache_queries
    computed = queried - (after.prefix_cache_hits - before.prefix_cache_hits)
    partial = len(PROMPT) - (len(PROMPT) - 1) // BLOCK * BLOCK
    assert queried == 3 * len(PROMPT)
    assert computed == len(PROMPT) + 2 * partial, computed
    details = answer.usage.prompt_tokens_details if answer.usage else None
    assert details is None or not details.cached_tokens  # the prompt's own prefill: cold


async def test_a_client_that_leaves_cancels_every_choice(agg: Deployment) -> None:
    async with (
        openai.AsyncOpenAI(base_url=f"{agg.url}/v1", api_key="none", max_retries=0) as client,
        DistributedRuntime(agg.discovery) as runtime,
    ):
        stream = await client.completions.create(
            model=agg.model, prompt=PROMPT, n=3, max_tokens=200, stream=True, extra_body=fresh()
        )
        seen: set[int] = set()
        async for chunk in stream:
            seen |= {c.index for c in chunk.choices}
            if len(seen) == 3:
                break
        assert (await worker_load(runtime, BACKEND)).running == 3  # every choice under way
        await stream.close()

        async def all_stopped() -> bool:
            load = await worker_load(runtime, BACKEND)
            return load.running == load.waiting == load.kv_blocks_used == 0

        await poll(all_stopped, 30, "a choice still runs at the worker")


# -- disaggregated ----------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["prefill-first", "decode-first"])
def disagg(
    request: pytest.FixtureRequest, chat_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    deployment = start_serve(
        chat_model,
        tmp_path_factory.mktemp("discovery"),
        "--mode",
        "disagg",
        "--num-threads",
        "1",
        "--kv-transfer",
        "shm",
        "--transfer-order",
        request.param,
        "--canary-period",
        "0",
    )
    wait_for_health(deployment.url, deployment.model, 1)
    yield deployment
    stop_cleanly(deployment)


async def disagg_loads(discovery: str) -> tuple[WorkerLoad, WorkerLoad]:
    """The prefill and the decode worker's loads."""
    async with DistributedRuntime(discovery) as runtime:
        prefill = await worker_load(runtime, "kvbaton.prefill.load_metrics")
        return prefill, await worker_load(runtime, BACKEND)


def test_one_kv_transfer_serves_every_choice(disagg: Deployment) -> None:
    """Choice 0 is prefilled on the prefill worker and its KV moves to the decode worker once;
    choices 1 and 2 are prefilled on the decode worker from the blocks that arrived."""
    client = openai.OpenAI(base_url=f"{disagg.url}/v1", api_key="none", max_retries=0)
    health = httpx.get(f"{disagg.url}/health").json()
    (decode,) = health["models"][disagg.model]
    (prefill,) = health["prefill"][disagg.model]
    prefill_before, decode_before = asyncio.run(disagg_loads(disagg.discovery))
    raw = client.completions.with_raw_response.create(
        model=disagg.model, prompt=PROMPT, n=3, max_tokens=8, temperature=0, extra_body=fresh()
    )
    answer = raw.parse()
    prefill_after, decode_after = asyncio.run(disagg_loads(disagg.discovery))
    assert sorted(raw.headers["x-kvbaton-worker"].split(",")) == sorted([prefill, decode])
    assert len(set(texts(answer))) == 1 and answer.usage is not None
    assert answer.usage.completion_tokens == 3 * 8
    handoffs = (
        prefill_after.kv_handoffs
        - prefill_before.kv_handoffs
        + decode_after.kv_handoffs
        - decode_before.kv_handoffs
    )
    assert handoffs == 1
    assert prefill_after.prefix_cache_queries - prefill_before.prefix_cache_queries == len(PROMPT)
    full = (len(PROMPT) - 1) // BLOCK * BLOCK
    assert decode_after.prefix_cache_hits - decode_before.prefix_cache_hits == 2 * full

    async def all_free() -> bool:
        loads = await disagg_loads(disagg.discovery)
        return not any(load.kv_blocks_used for load in loads)

    asyncio.run(poll(all_free, 30, "blocks still in use"))


def test_pinned_choices_all_go_to_the_named_worker(disagg: Deployment) -> None:
    client = openai.OpenAI(base_url=f"{disagg.url}/v1", api_key="none", max_retries=0)
    (decode,) = httpx.get(f"{disagg.url}/health").json()["models"][disagg.model]
    raw = client.completions.with_raw_response.create(
        model=disagg.model,
        prompt=OTHER,
        n=2,
        max_tokens=4,
        temperature=0,
        extra_body={"nvext": {"backend_instance_id": decode}, "ignore_eos": True},
    )
    assert raw.headers["x-kvbaton-worker"] == decode  # no prefill worker either
    assert [c.index for c in raw.parse().choices] == [0, 1]


# -- migration, on mocker workers -------------------------------------------------------------
SLOW_DECODE = ("--speedup-ratio", "0.2")  # about 30 ms a token: 40 tokens are about 1.2 s


async def loads_by_worker(runtime: DistributedRuntime) -> dict[int, WorkerLoad]:
    """Each live worker's load (a dead one that discovery still lists is skipped)."""
    client = await runtime.endpoint(f"{NS}.backend.load_metrics").client(response_type=WorkerLoad)
    loads: dict[int, WorkerLoad] = {}
    try:
        for instance in client.instance_ids():
            try:
                loads[instance] = await anext(client.direct(None, instance, timeout=5))
            except Exception:  # killed: gone
                continue
    finally:
        await client.close()
    return loads


async def stream_choices(client: openai.AsyncOpenAI, model: str) -> Streamed:
    streamed = Streamed()
    stream = await client.completions.create(
        model=model,
        prompt=PROMPT,
        n=2,
        max_tokens=40,
        temperature=0,
        seed=5,  # greedy, so it may migrate; the mocker's choices differ by their seeds
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        streamed.add(chunk, chat=False)
    return streamed


async def test_choices_whose_worker_is_killed_mid_stream_migrate(
    chat_model: Path, spawn_worker: WorkerFactory, tmp_path: Path
) -> None:
    async with running_frontend(tmp_path, "--canary-period", "0") as frontend:
        procs = [mocker(spawn_worker, chat_model, "agg", *SLOW_DECODE) for _ in range(2)]
        await ready(frontend, chat_model, prefill=0, serving=2)
        by_id = {instance_id(worker_log(tmp_path, i)): proc for i, proc in enumerate(procs)}
        async with client_of(frontend) as client, DistributedRuntime(frontend.discovery) as rt:
            reference = await stream_choices(client, chat_model.name)
            assert reference.texts[0] != reference.texts[1]
            disturbed = asyncio.create_task(stream_choices(client, chat_model.name))
            victims: list[int] = []

            async def both_choices_decoding_on_one_worker() -> bool:
                loads = await loads_by_worker(rt)
                victims[:] = [
                    w for w, x in loads.items() if x.running == 2 and not x.active_prefill_tokens
                ]
                return bool(victims)

            await poll(both_choices_decoding_on_one_worker, 30, "the choices never shared a worker")
            victim = by_id.pop(victims[0])
            victim.send_signal(signal.SIGKILL)
            streamed = await disturbed
            assert victim.wait(10) == -signal.SIGKILL
            assert streamed.texts == reference.texts  # every token, once, in order
            assert streamed.finishes == {0: ["length"], 1: ["length"]}
            assert streamed.usage.completion_tokens == 2 * 40
            assert streamed.usage.prompt_tokens == len(PROMPT)
            (survivor,) = by_id

            async def survivor_free() -> bool:
                loads = await loads_by_worker(rt)
                return survivor in loads and loads[survivor].kv_blocks_used == 0

            await poll(survivor_free, 30, "the survivor still holds blocks")
