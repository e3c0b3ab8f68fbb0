"""Disaggregation when things go wrong, on mocker workers started one by one: a prefill worker
killed mid-prefill (the decode worker prefills instead), a decode worker killed mid-decode, a
client leaving while the KV is on its way, held KV nobody comes for, held KV whose hold ran out
before the decode worker read it (on the real engine); and the frontend's choices
(--enforce-disagg, --max-local-prefill-tokens). After each, both workers' blocks are all free
(their `load_metrics`)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import openai
import pytest

from kvbaton.disagg.rooms import ROOM_ENDINGS
from kvbaton.protocols.llm import EngineOutput, PreprocessedRequest, SamplingParams
from kvbaton.runtime import DistributedRuntime
from tests.conftest import WorkerFactory
from tests.frontend.fleet import (
    NS,
    all_free,
    client_of,
    load,
    mocker,
    model_row,
    poll,
    ready,
    running_frontend,
)
from tests.helpers import scraped
from tests.servers import free_port

pytestmark = pytest.mark.integration

LONG = [(i * 13) % 200 + 20 for i in range(1500)]  # 1.5 s of prefill at 1 ms a token
TRANSFER_TIMEOUT = ("--kv-transfer-timeout", "5")


@pytest.mark.parametrize("order", ["prefill-first", "decode-first"])
async def test_a_prefill_worker_killed_mid_prefill_leaves_the_decode_worker_to_prefill(
    chat_model: Path, spawn_worker: WorkerFactory, tmp_path: Path, order: str
) -> None:
    async with running_frontend(tmp_path, "--transfer-order", order) as frontend:
        # Decode-first: the blocks the killed writer claimed stay out of use for three times the
        # transfer timeout after its claim ended (a write of its may still have been in flight).
        prefill = mocker(
            spawn_worker, chat_model, "prefill", "--mocker-prefill", "0,1,0", *TRANSFER_TIMEOUT
        )
        port = free_port()  # the decode worker's /metrics
        decode_flags = ("--speedup-ratio", "10", "--system-port", str(port), *TRANSFER_TIMEOUT)
        mocker(spawn_worker, chat_model, "decode", *decode_flags)
        await ready(frontend, chat_model)
        async with client_of(frontend) as client, DistributedRuntime(frontend.discovery) as rt:
            reference = await client.completions.create(
                model=chat_model.name,
                prompt=LONG[:100],
                max_tokens=20,
                extra_body={"ignore_eos": True},
            )
            request = asyncio.create_task(
                client.completions.create(
                    model=chat_model.name,
                    prompt=LONG,
                    max_tokens=20,
                    extra_body={"ignore_eos": True},
                )
            )

            async def prefilling() -> bool:  # the prefill worker is busy with the long prompt
                return (await load(rt, "prefill")).running > 0

            await poll(prefilling, 30, "the prefill worker never took the long prompt")
            prefill.send_signal(signal.SIGKILL)
            out = await request
            assert out.usage is not None and out.usage.completion_tokens == 20
            outcomes: dict[str, int] = {}

            async def counted() -> bool:  # the killed prefill's call may fail after the answer
                outcomes.update((await model_row(frontend))["disaggregated"])
                return outcomes["answered"] + outcomes["fallbacks"] == 2

            await poll(counted, 10, "the killed prefill's outcome was never counted")
            assert outcomes["answered"] == 1  # the reference
            assert outcomes["fallbacks"] == 1  # prefilled on the decode worker
            assert reference.choices[0].text  # the deployment worked before the kill
            await all_free(rt, "backend")
            metrics = f"http://127.0.0.1:{port}/metrics"
            name = "kvbaton_disagg_rooms_total"
            endings = {how: scraped(metrics, name, outcome=how) for how in ROOM_ENDINGS}
        if order == "decode-first":  # the killed writer's claim ended with its process
            assert endings == {**dict.fromkeys(ROOM_ENDINGS, 0), "written": 1, "writer_lost": 1}
        else:  # no room: the decode worker read the KV
            assert not any(endings.values())


async def test_a_decode_worker_killed_mid_decode_frees_the_prefill_workers_blocks(
    chat_model: Path, spawn_worker: WorkerFactory, tmp_path: Path
) -> None:
    async with running_frontend(tmp_path) as frontend:
        mocker(spawn_worker, chat_model, "prefill", "--speedup-ratio", "10")
        decode = mocker(spawn_worker, chat_model, "decode", "--mocker-decode", "0,0,50")
        await ready(frontend, chat_model)
        async with client_of(frontend) as client, DistributedRuntime(frontend.discovery) as rt:
            stream = await client.completions.create(
                model=chat_model.name,
                prompt=LONG[:300],
                max_tokens=200,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            with pytest.raises(openai.APIError, match="worker"):
                count = 0
                async for _ in stream:
                    count += 1
                    if count == 3:
                        decode.send_signal(signal.SIGKILL)
            await all_free(rt, "prefill")


@pytest.mark.parametrize("order", ["prefill-first", "decode-first"])
async def test_a_client_leaving_while_the_kv_is_on_its_way_frees_everything(
    chat_model: Path, spawn_worker: WorkerFactory, tmp_path: Path, order: str
) -> None:
    async with running_frontend(tmp_path, "--transfer-order", order) as frontend:
        mocker(spawn_worker, chat_model, "prefill", "--mocker-prefill", "0,1,0")
        mocker(spawn_worker, chat_model, "decode")
        await ready(frontend, chat_model)
        async with client_of(frontend) as client, DistributedRuntime(frontend.discovery) as rt:
            request = asyncio.create_task(
                client.completions.create(model=chat_model.name, prompt=LONG, max_tokens=20)
            )

            async def mid_prefill() -> bool:  # decode-first: its blocks wait for the KV
                busy = await load(rt, "prefill")
                decode = await load(rt, "backend")
                waits = order == "prefill-first" or decode.kv_blocks_used == -(-len(LONG) // 16)
                return busy.waiting + busy.running == 1 and waits

            await poll(mid_prefill, 30, "the prefill worker never took the prompt")
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
            await all_free(rt, "prefill", "backend")


async def test_held_kv_nobody_fetches_is_freed_after_the_hold_timeout(
    chat_model: Path, spawn_worker: WorkerFactory, discovery_url: str
) -> None:
    mocker(spawn_worker, chat_model, "prefill", "--kv-hold-timeout", "1")
    async with DistributedRuntime(discovery_url) as rt:
        client = await rt.endpoint(f"{NS}.prefill.generate").client(response_type=EngineOutput)
        await client.wait_for_instances(60)
        request = PreprocessedRequest(
            model=chat_model.name, token_ids=LONG[:100], sampling=SamplingParams(max_tokens=5)
        )
        (answer,) = [out async for out in client.round_robin(request)]
        await client.close()
        assert answer.disaggregated_params is not None
        assert len(answer.disaggregated_params.block_ids) == 7  # 100 tokens in blocks of 16
        assert (await load(rt, "prefill")).kv_blocks_used == 7
        await all_free(rt, "prefill")


async def test_kv_whose_hold_ran_out_before_the_decode_worker_read_it_is_not_used(
    chat_model: Path, spawn_worker: WorkerFactory, tmp_path: Path
) -> None:
    """Prefill-first, on the real engine: B's KV waits on the prefill worker while B queues on a
    busy decode worker; B's hold runs out and C's prefill takes its blocks. The decode worker
    then reads C's KV from them: it must not use it (the release's answer says the hold had
    ended), and prefills B itself. B's and C's greedy tokens equal the decode worker's own."""
    real = ("--engine", "torch", "--model", str(chat_model), "--block-size", "16")
    spawn_worker(*real, "--role", "prefill", "--num-kv-blocks", "16", "--kv-hold-timeout", "0.3")
    port = free_port()  # the decode worker's /metrics
    spawn_worker(*real, "--role", "decode", "--max-num-seqs", "1", "--system-port", str(port))
    prompt_b = LONG[:40]  # 3 blocks
    prompt_c = LONG[500:750]  # all 16 blocks of the prefill worker: it waits for B's
    async with running_frontend(tmp_path) as frontend:
        await ready(frontend, chat_model)
        async with (
            client_of(frontend) as client,
            httpx.AsyncClient() as http,
            DistributedRuntime(frontend.discovery) as rt,
        ):
            (decode,) = (await http.get(f"{frontend.url}/health")).json()["models"][chat_model.name]

            async def complete(prompt: list[int], max_tokens: int, pinned: bool = False) -> str:
                extra: dict[str, object] = {"ignore_eos": True}
                if pinned:  # whole on the decode worker
                    extra["nvext"] = {"backend_instance_id": decode}
                out = await client.completions.create(
                    model=chat_model.name,
                    prompt=prompt,
                    max_tokens=max_tokens,
                    temperature=0,
                    extra_body=extra,
                )
                return out.choices[0].text

            # The decode worker runs one request at a time: these keep it busy for seconds.
            busy = [asyncio.create_task(complete(LONG[i : i + 8], 240, True)) for i in range(4)]

            async def queued() -> bool:
                return (await load(rt, "backend")).waiting > 0

            await poll(queued, 30, "the decode worker never queued a request")
            b = asyncio.create_task(complete(prompt_b, 8))
            c = asyncio.create_task(complete(prompt_c, 4))
            texts = await asyncio.gather(b, c, *busy)
            assert texts[0] == await complete(prompt_b, 8, pinned=True)
            assert texts[1] == await complete(prompt_c, 4, pinned=True)
            await all_free(rt, "prefill", "backend")
    reads = f"http://127.0.0.1:{port}/metrics", "kvbaton_disagg_reads_total"
    assert scraped(*reads, outcome="hold_ended") >= 1  # B's (C's too, if it queued long)
    assert scraped(*reads, outcome="read_failed") == 0


async def test_enforce_disagg_refuses_without_a_prefill_worker(
    chat_model: Path, spawn_worker: WorkerFactory, tmp_path: Path
) -> None:
    async with running_frontend(tmp_path, "--enforce-disagg") as frontend:
        mocker(spawn_worker, chat_model, "decode")
        await ready(frontend, chat_model, prefill=0)
        async with client_of(frontend) as client:
            with pytest.raises(openai.APIStatusError) as refused:
                await client.completions.create(model=chat_model.name, prompt="Hi", max_tokens=2)
        assert refused.value.status_code == 503 and "prefill" in refused.value.message


async def test_short_uncached_prompts_are_prefilled_on_the_decode_worker(
    chat_model: Path, spawn_worker: WorkerFactory, tmp_path: Path
) -> None:
    async with running_frontend(tmp_path, "--max-local-prefill-tokens", "64") as frontend:
        mocker(spawn_worker, chat_model, "prefill", "--speedup-ratio", "10")
        mocker(spawn_worker, chat_model, "decode", "--speedup-ratio", "10")
        await ready(frontend, chat_model)
        async with client_of(frontend) as client:

            async def indexed() -> bool:  # the decode worker's KV events reached the router
                name, url = "kvbaton_router_indexed_blocks", f"{frontend.url}/metrics"
                blocks = await asyncio.to_thread(scraped, url, name, component=f"{NS}.backend")
                return blocks >= 300 // 16

            for length, workers in [(40, 1), (300, 2), (300 + 40, 1)]:  # the last: 288 cached
                if length == 300 + 40:
                    await poll(indexed, 30, "the decode worker's KV never reached the router")
                raw = await client.completions.with_raw_response.create(
                    model=chat_model.name, prompt=LONG[:length], max_tokens=4
                )
                served = raw.headers["x-kvbaton-worker"].split(",")
                assert len(served) == workers, (length, served)
