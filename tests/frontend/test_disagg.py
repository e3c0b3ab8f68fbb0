"""Disaggregated serving through a real deployment: `kvbaton serve --mode disagg` (a prefill and
a decode worker) on a tiny random model, in both transfer orders, the KV moving over shared
memory, TCP or NIXL (decode-first: written layer by layer as the prefill worker computes it, or
whole blocks at the end with `--kv-push blocks`). Greedy tokens equal aggregated serving's (the
same decode worker, pinned, runs the request whole), with and without prefix-cache hits on
either side; every block comes back on both workers."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvbaton.protocols.llm import EngineOutput, PreprocessedRequest, SamplingParams, WorkerLoad
from kvbaton.runtime import DistributedRuntime, HandlerError
from tests.frontend.conftest import (
    Deployment,
    start_serve,
    stop_cleanly,
    wait_for_health,
    worker_load,
)
from tests.helpers import scraped, wait_until_sync
from tests.servers import free_ports

pytestmark = pytest.mark.integration

PROMPT_LENGTHS = [1, 5, 16, 17, 40, 100]  # block size 16: partial, whole and several blocks


def prompts() -> list[list[int]]:
    return [[(7 * n + 3 * i) % 200 + 20 for i in range(n)] for n in PROMPT_LENGTHS]


async def loads(discovery: str) -> tuple[WorkerLoad, WorkerLoad]:
    """The prefill and the decode worker's loads."""
    async with DistributedRuntime(discovery) as runtime:
        prefill = await worker_load(runtime, "kvbaton.prefill.load_metrics")
        return prefill, await worker_load(runtime, "kvbaton.backend.load_metrics")


async def blocks_in_use(discovery: str) -> tuple[int, int]:
    """(prefill, decode) KV blocks in use."""
    prefill, decode = await loads(discovery)
    return prefill.kv_blocks_used, decode.kv_blocks_used


async def wait_all_blocks_free(discovery: str) -> None:
    last: list[tuple[int, int]] = []

    async def free() -> bool:
        last.append(await blocks_in_use(discovery))
        return last[-1] == (0, 0)

    deadline = asyncio.get_running_loop().time() + 30
    while not await free():
        assert asyncio.get_running_loop().time() < deadline, f"blocks still in use: {last[-1]}"
        await asyncio.sleep(0.2)


@dataclass
class Disagg(Deployment):
    backend: str = ""
    order: str = ""
    push: str = ""
    system_ports: int = 0  # the prefill worker's; the decode worker's is the next


@pytest.fixture(
    scope="module",
    params=[
        ("shm", "prefill-first", "layers"),
        ("tcp", "prefill-first", "layers"),
        ("shm", "decode-first", "layers"),
        ("tcp", "decode-first", "layers"),
        ("nixl", "prefill-first", "layers"),
        ("nixl", "decode-first", "layers"),
        ("shm", "decode-first", "blocks"),
    ],
    ids=lambda p: "-".join(p).removesuffix("-layers"),
)
def disagg(
    request: pytest.FixtureRequest, chat_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Disagg]:
    backend, order, push = request.param
    system_ports = free_ports(2)
    deployment = start_serve(
        chat_model,
        tmp_path_factory.mktemp("discovery"),
        "--mode",
        "disagg",
        "--worker-system-ports",
        str(system_ports),
        "--num-threads",
        "1",
        "--kv-transfer",
        backend,
        "--transfer-order",
        order,
        "--kv-push",
        push,
    )
    wait_for_health(deployment.url, deployment.model, 1)
    yield Disagg(
        **vars(deployment), backend=backend, order=order, push=push, system_ports=system_ports
    )
    stop_cleanly(deployment)


def complete(
    url: str, model: str, prompt: list[int], max_tokens: int = 12, **extra: object
) -> tuple[str, list[str]]:
    """The completion's text and the workers that served it."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    raw = client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, **extra
    )
    return raw.parse().choices[0].text, raw.headers["x-kvbaton-worker"].split(",")


def test_a_constrained_answer_is_the_same_disaggregated(disagg: Disagg) -> None:
    """The prefill worker samples the first token under the constraint; the decode worker
    replays it through the grammar and goes on: the answer is the one a single worker gives."""
    health = httpx.get(f"{disagg.url}/health").json()
    (decode,) = health["models"][disagg.model]
    pattern = r"[a-z]{2,6}( [a-z]{2,6}){2}\."
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 99}, "s": {"enum": ["a", "b"]}},
        "required": ["n", "s"],
    }
    for prompt in prompts()[:2]:
        for constraint in ({"guided_regex": pattern}, {"guided_json": schema}):
            split, _ = complete(disagg.url, disagg.model, prompt, 40, extra_body=constraint)
            pinned = constraint | {"nvext": {"backend_instance_id": decode}}
            whole, workers = complete(disagg.url, disagg.model, prompt, 40, extra_body=pinned)
            assert workers == [decode]
            assert split == whole, (constraint, split, whole)
            if "guided_regex" in constraint:
                assert re.fullmatch(pattern, split)


def test_disaggregated_tokens_equal_aggregated(disagg: Disagg) -> None:
    health = httpx.get(f"{disagg.url}/health").json()
    (decode,) = health["models"][disagg.model]
    (prefill,) = health["prefill"][disagg.model]
    both = [prefill, decode]
    for prompt in prompts():
        cold, workers = complete(disagg.url, disagg.model, prompt)
        # Prefill-first names the prefill worker first (it answered first); decode-first, the
        # worker whose answer the frontend saw first.
        if disagg.order == "prefill-first":
            assert workers == both
        else:
            assert sorted(workers) == sorted(both)
        whole, workers = complete(
            disagg.url,
            disagg.model,
            prompt,
            extra_body={"nvext": {"backend_instance_id": decode}},
        )
        assert workers == [decode]
        warm, workers = complete(disagg.url, disagg.model, prompt)  # hits on both sides
        assert sorted(workers) == sorted(both), (len(prompt), disagg.log_text()[-4000:])
        assert cold == whole == warm, len(prompt)
    prefill_load, decode_load = asyncio.run(loads(disagg.discovery))
    mover = decode_load if disagg.order == "prefill-first" else prefill_load
    assert mover.kv_transfer_bytes > 0 and mover.kv_transfer_seconds > 0
    assert mover.kv_transfer_bytes_by_backend == {disagg.backend: mover.kv_transfer_bytes}
    if disagg.order == "decode-first" and disagg.push == "layers":
        # Every block went as the prompt was computed (none was cached here and not there).
        assert mover.kv_layered_transfers > 0 and mover.kv_whole_blocks == 0
    else:
        assert mover.kv_layered_transfers == 0 and mover.kv_whole_blocks > 0
    assert mover.kv_handoffs >= len(PROMPT_LENGTHS) - 1  # (a 1-token prompt needs no KV moved)
    assert mover.kv_handoff_wait_seconds > 0
    # The cluster page's data says the same: prefills answered, and the mover's handoffs.
    cluster = httpx.get(f"{disagg.url}/v1/cluster").json()
    (model,) = cluster["models"]
    assert model["disaggregated"]["answered"] >= 2 * len(PROMPT_LENGTHS)  # cold and warm
    assert (model["disaggregated"]["fallbacks"], model["disaggregated"]["failures"]) == (0, 0)
    assert sorted(w["role"] for w in cluster["workers"]) == ["decode", "prefill"]
    mover_role = "decode" if disagg.order == "prefill-first" else "prefill"

    def shown_handoffs() -> int:
        workers = httpx.get(f"{disagg.url}/v1/cluster").json()["workers"]
        (row,) = [w for w in workers if w["role"] == mover_role]
        return int(row["load"]["kv_handoffs"]) if row["load"] else 0

    wait_until_sync(lambda: shown_handoffs() >= mover.kv_handoffs, what="the handoffs shown")
    asyncio.run(wait_all_blocks_free(disagg.discovery))
    # The decode worker counts how each handoff ended on its /metrics (--worker-system-ports).
    decode_metrics = f"http://127.0.0.1:{disagg.system_ports + 1}/metrics"
    if disagg.order == "prefill-first":
        handoffs, ended, failed = "kvbaton_disagg_reads_total", "read", "read_failed"
    else:
        handoffs, ended, failed = "kvbaton_disagg_rooms_total", "written", "write_failed"
    assert scraped(decode_metrics, handoffs, outcome=ended) >= len(PROMPT_LENGTHS) - 1
    assert scraped(decode_metrics, handoffs, outcome=failed) == 0
    assert httpx.get(f"http://127.0.0.1:{disagg.system_ports}/health").status_code == 200


def test_a_prompt_scored_with_echo_is_computed_whole_on_the_decode_worker(
    disagg: Disagg,
) -> None:
    """A prompt's logprobs are read where it is computed: the decode worker serves it alone,
    as it does pinned."""
    health = httpx.get(f"{disagg.url}/health").json()
    (decode,) = health["models"][disagg.model]
    client = openai.OpenAI(base_url=f"{disagg.url}/v1", api_key="none", max_retries=0)
    ask: dict[str, Any] = {"model": disagg.model, "prompt": prompts()[-1], "max_tokens": 4}
    ask |= {"temperature": 0, "echo": True, "logprobs": 2}
    raw = client.completions.with_raw_response.create(**ask)
    assert raw.headers["x-kvbaton-worker"].split(",") == [decode]
    pinned = client.completions.create(**ask, extra_body={"nvext": {"backend_instance_id": decode}})
    scored = raw.parse().choices[0].logprobs
    assert scored is not None and scored.token_logprobs is not None
    assert len(scored.token_logprobs) == len(prompts()[-1]) + 4
    assert scored == pinned.choices[0].logprobs
    with pytest.raises(HandlerError) as refused:  # sent to the prefill worker all the same
        asyncio.run(send_directly(disagg, prompts()[-1], SamplingParams(prompt_logprobs=0)))
    assert refused.value.error_type == "ValueError"
    asyncio.run(wait_all_blocks_free(disagg.discovery))


async def send_directly(
    disagg: Disagg,
    prompt: list[int],
    sampling: SamplingParams,
    component: str = "prefill",
    bootstrap: bool = False,
) -> list[EngineOutput]:
    """A worker's outputs (the prefill worker's, or "backend": the decode worker's) for a
    request sent to it over the request plane."""
    async with DistributedRuntime(disagg.discovery) as runtime:
        endpoint = runtime.endpoint(f"kvbaton.{component}.generate")
        client = await endpoint.client(response_type=EngineOutput)
        try:
            await client.wait_for_instances(30)
            request = PreprocessedRequest(
                model=disagg.model, token_ids=prompt, sampling=sampling, bootstrap=bootstrap
            )
            return [out async for out in client.round_robin(request)]
        finally:
            await client.close()


def test_logprobs_are_the_same_disaggregated(disagg: Disagg) -> None:
    """A request for logprobs goes prefill-first in either order (the first token's come with
    the prefill worker's answer): its tokens and logprobs are those of a single worker."""
    health = httpx.get(f"{disagg.url}/health").json()
    (decode,) = health["models"][disagg.model]
    (prefill,) = health["prefill"][disagg.model]
    client = openai.OpenAI(base_url=f"{disagg.url}/v1", api_key="none", max_retries=0)
    ask: dict[str, Any] = {"model": disagg.model, "prompt": prompts()[4], "max_tokens": 8}
    ask |= {"temperature": 0, "logprobs": 2}
    raw = client.completions.with_raw_response.create(**ask)
    assert raw.headers["x-kvbaton-worker"].split(",") == [prefill, decode]
    pinned = client.completions.create(**ask, extra_body={"nvext": {"backend_instance_id": decode}})
    split, whole = raw.parse().choices[0].logprobs, pinned.choices[0].logprobs
    assert split is not None and whole is not None and split.token_logprobs is not None
    assert split.tokens == whole.tokens and len(split.token_logprobs) == 8
    assert split.token_logprobs == pytest.approx(whole.token_logprobs, abs=1e-4)
    assert [list(top) for top in split.top_logprobs or []] == [
        list(top) for top in whole.top_logprobs or []
    ]
    with pytest.raises(HandlerError) as refused:  # a decode-first bootstrap all the same
        sampling = SamplingParams(max_tokens=2, logprobs=0)
        asyncio.run(send_directly(disagg, prompts()[4], sampling, "backend", bootstrap=True))
    assert refused.value.error_type == "ValueError"
    asyncio.run(wait_all_blocks_free(disagg.discovery))


def test_streams_usage_and_cached_tokens(disagg: Disagg) -> None:
    client = openai.OpenAI(base_url=f"{disagg.url}/v1", api_key="none", max_retries=0)
    prompt = prompts()[-1]
    chunks = list(
        client.completions.create(
            model=disagg.model,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == complete(disagg.url, disagg.model, prompt, max_tokens=8)[0]
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (100, 8)
    asyncio.run(wait_all_blocks_free(disagg.discovery))


async def test_a_client_leaving_mid_stream_frees_blocks_on_both_workers(
    disagg: Disagg,
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{disagg.url}/v1", api_key="none", max_retries=0)
    async with client:
        for _ in range(3):
            stream = await client.completions.create(
                model=disagg.model,
                prompt=prompts()[-1],
                max_tokens=150,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for _chunk in stream:
                break
            await stream.close()
    await wait_all_blocks_free(disagg.discovery)


async def test_requests_that_stop_at_the_first_token_hold_nothing(disagg: Disagg) -> None:
    client = openai.AsyncOpenAI(base_url=f"{disagg.url}/v1", api_key="none", max_retries=0)
    async with client:
        out = await client.completions.create(
            model=disagg.model, prompt=prompts()[2], max_tokens=1, temperature=0
        )
    assert out.choices[0].finish_reason == "length"
    assert await blocks_in_use(disagg.discovery) == (0, 0)
