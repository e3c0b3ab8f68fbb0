"""`kvbaton serve --engine vllm --workers 2` on SmolLM2 (issue 30, aggregated): greedy answers
equal vLLM's own offline `LLM.generate`, a left stream leaves vLLM running nothing, busy
workers (by vLLM's KV usage) shed new requests, a prompt in its first step counts in its
worker's load, a JSON schema holds, an over-long prompt is a 400, the KV router sends a
shared prefix back to the worker whose vLLM cached it (predicting the cached tokens vLLM
reports), a stream whose worker is killed migrates (a constrained one too), a worker whose
vLLM engine core dies exits for serve to start a new one, and a worker killed with SIGKILL
leaves no vLLM process behind, nor vLLM's ipc sockets.

One deployment serves the module, in file order: a test that needs both workers waits for them
(`both_ready`), and the tests that need one follow a migration test's kill, so that serve's
restart of the killed worker (about 35 s on 2 cores) goes on while they run.

Runs where vLLM is installed (the environment scripts/vllm_env.sh builds):
`.venv-vllm/bin/python -m pytest -m vllm tests/frontend/test_vllm_serve.py`; skipped elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import openai
import pytest

from kvbaton.engine.vllm_reaper import descendants, start_time
from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import DistributedRuntime
from tests.frontend.conftest import Deployment, live_instances, serve_slot, stop_serve
from tests.frontend.fleet import poll
from tests.frontend.vllm_helpers import (
    MAX_MODEL_LEN,
    MAX_TOKENS,
    MODEL_DIR,
    READY_S,
    SAMPLINGS,
    VLLM_MARKS,
    offline_texts,
    prompt_ids,
    serve_vllm,
)
from tests.helpers import wait_until_sync

pytestmark = VLLM_MARKS
BACKEND = "kvbaton.backend.load_metrics"
VLLM_BLOCK = 128  # vLLM's block size on a CPU, by default
INDEXED = "kvbaton_router_indexed_blocks"  # per worker: the blocks the KV router knows it has


@pytest.fixture(scope="module")
def offline() -> list[str]:
    return offline_texts()


@pytest.fixture(scope="module")
def ipc_base() -> Iterator[Path]:
    """Where the deployment's vLLM engines make their ipc sockets (a short path: theirs start
    with it)."""
    path = Path(tempfile.mkdtemp(prefix="kvb-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def vllm_serve(
    offline: list[str], tmp_path_factory: pytest.TempPathFactory, ipc_base: Path
) -> Iterator[Deployment]:
    discovery = tmp_path_factory.mktemp("discovery")
    deployment = serve_vllm(discovery, "--workers", "2", ipc_base=ipc_base)
    yield deployment
    stop_serve(deployment.proc)


@pytest.fixture
def client(vllm_serve: Deployment) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{vllm_serve.url}/v1", api_key="none", max_retries=0) as c:
        yield c


def both_ready(deployment: Deployment) -> None:
    """Until serve has both workers ready and the frontend lists just those two: a test that
    needs both waits here, so that serve's restart of a worker an earlier test killed goes on
    while tests that need only one worker run."""
    wait_until_sync(
        lambda: (
            len(live_instances(deployment.url, deployment.model)) == 2
            and all(serve_slot(deployment, f"worker-{i}")["state"] == "ready" for i in (0, 1))
        ),
        READY_S,
        "both vLLM workers ready",
    )


async def test_busy_vllm_workers_shed_new_requests(vllm_serve: Deployment) -> None:
    """Busy detection reads vLLM's KV usage as the worker reports it: with a threshold that
    any running request passes, one long stream on each worker makes both busy, a new request
    gets a 503 with Retry-After at once, and once the streams end it is served."""
    both_ready(vllm_serve)
    url, model = vllm_serve.url, vllm_serve.model
    long: dict[str, Any] = {"max_tokens": 400, "stream": True, "extra_body": {"ignore_eos": True}}
    async with (
        httpx.AsyncClient(base_url=url) as http,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as ai,
        contextlib.AsyncExitStack() as streams,
    ):
        before = (await http.get("/busy_threshold")).json()
        busy = {"kv_usage": 0.001, "prefill_tokens": None}  # one block in use is busy
        assert (await http.post("/busy_threshold", json=busy)).status_code == 200
        try:
            workers: set[str] = set()
            for take in range(6):  # until each worker runs one (the router spreads them)
                raw = await ai.completions.with_raw_response.create(
                    model=model, prompt=f"Count to a thousand, take {take}:", **long
                )
                await streams.enter_async_context(raw.parse())
                workers.add(raw.headers["x-kvbaton-worker"])
                if len(workers) == 2:
                    break
            assert len(workers) == 2, workers

            async def shed() -> bool:
                try:
                    await ai.completions.create(model=model, prompt="Hi", max_tokens=1)
                except openai.APIStatusError as exc:
                    assert exc.status_code == 503, exc
                    assert exc.response.headers["retry-after"] == str(before["retry_after_s"])
                    return True
                return False

            await poll(shed, 60, "no 503 while both vLLM workers run a stream")
            await streams.aclose()  # the streams end: vLLM aborts them

            async def served() -> bool:
                with contextlib.suppress(openai.APIStatusError):
                    await ai.completions.create(model=model, prompt="Hi", max_tokens=1)
                    return True
                return False

            await poll(served, 60, "still shed once the streams ended")
        finally:
            limits = {key: before[key] for key in busy}
            assert (await http.post("/busy_threshold", json=limits)).status_code == 200


def test_a_shared_prefix_goes_back_to_the_worker_whose_vllm_cached_it(
    vllm_serve: Deployment,
) -> None:
    """vLLM's KV events, re-hashed the kvbaton way, feed the KV router: a second prompt sharing
    a 600-token prefix goes where the first went, vLLM finds 4 of its 128-token blocks cached,
    and the router predicted just as many."""
    both_ready(vllm_serve)
    url, model = vllm_serve.url, vllm_serve.model
    prefix = list(range(2000, 2600))
    workers = [f"{w:x}" for w in live_instances(url, model)]
    indexed = {w: metric(url, INDEXED, worker=w) for w in workers}  # earlier tests' blocks
    worker, cached = complete_ids(url, model, [*prefix, *range(5000, 5040)])
    assert cached == 0
    wait_until_sync(
        lambda: metric(url, INDEXED, worker=worker) >= indexed[worker] + 5,
        30,
        "the router hearing of the first prompt's blocks",
    )
    predicted = metric(url, "kvbaton_router_overlap_blocks_sum")
    again, cached = complete_ids(url, model, [*prefix, *range(6000, 6040)])
    predicted = metric(url, "kvbaton_router_overlap_blocks_sum") - predicted
    assert again == worker
    assert cached >= 512
    assert predicted * VLLM_BLOCK == cached


def complete_ids(url: str, model: str, prompt: list[int]) -> tuple[str, int]:
    """(the worker that served `prompt`, the prompt tokens vLLM found cached)."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=2)
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens == len(prompt)
    details = usage.prompt_tokens_details
    return raw.headers["x-kvbaton-worker"], (details.cached_tokens or 0) if details else 0


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the frontend's samples of `name` with `labels` (0 if none)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


async def test_a_prompt_in_its_first_step_counts_as_waiting_prefill(
    vllm_serve: Deployment,
) -> None:
    """vLLM reports its scheduler only at a step's end, and a long prompt's first step is long
    on a CPU: meanwhile its worker counts it as waiting, not idle, and its tokens as prefill to
    do (the frontend's canaries, shedding and router read that load); none once answered."""
    async with (
        openai.AsyncOpenAI(base_url=f"{vllm_serve.url}/v1", api_key="none", max_retries=0) as ai,
        DistributedRuntime(vllm_serve.discovery) as runtime,
    ):
        prompt = list(range(3000, 3512))  # cached nowhere
        answer = asyncio.create_task(
            ai.completions.create(model=vllm_serve.model, prompt=prompt, max_tokens=1)
        )
        counted = False

        async def counted_or_ended() -> bool:
            nonlocal counted
            counted = any(
                load.waiting and load.active_prefill_tokens >= len(prompt)
                for load in await all_loads(runtime)
            )
            return counted or answer.done()

        await poll(counted_or_ended, 120, "the prompt neither counted nor answered")
        await answer
        assert counted, "its worker counted it neither waiting nor as prefill until it answered"

        async def prefilled() -> bool:
            return not any(load.active_prefill_tokens for load in await all_loads(runtime))

        await poll(prefilled, 30, "prefill still counted after the answer")


async def all_loads(runtime: DistributedRuntime) -> list[WorkerLoad]:
    """Every worker's load (each instance asked directly)."""
    client = await runtime.endpoint(BACKEND).client(response_type=WorkerLoad)
    try:
        await client.wait_for_instances(READY_S)
        loads: list[WorkerLoad] = []
        for instance in client.instance_ids():
            loads += [load async for load in client.direct(None, instance)]
        return loads
    finally:
        await client.close()


async def test_a_left_stream_leaves_vllm_running_nothing(vllm_serve: Deployment) -> None:
    async with (
        openai.AsyncOpenAI(base_url=f"{vllm_serve.url}/v1", api_key="none", max_retries=0) as ai,
        DistributedRuntime(vllm_serve.discovery) as runtime,
    ):
        stream = await ai.completions.create(
            model=vllm_serve.model,
            prompt="Count to a thousand:",
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = 0
        async for _ in stream:
            chunks += 1
            if chunks == 3:
                break
        running = await all_loads(runtime)
        assert sum(load.running for load in running) >= 1, running  # vLLM's scheduler says so
        assert all(load.kv_blocks_total > 0 for load in running), running
        await stream.close()

        async def nothing_runs() -> bool:
            return all(load.running == load.waiting == 0 for load in await all_loads(runtime))

        await poll(nothing_runs, 30, "vLLM still runs the left request")


def test_a_stream_whose_worker_is_killed_migrates(vllm_serve: Deployment) -> None:
    """A greedy stream's worker is killed after its first tokens: the stream goes on at the
    other worker, from where it was, to its full length. (Serve's restart of the worker goes on
    while the tests after this one that need only one worker run.)"""
    both_ready(vllm_serve)
    url, model = vllm_serve.url, vllm_serve.model
    prompt, max_tokens = "List the numbers from one to two hundred:", 96
    greedy: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        reference = client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, **greedy
        )
        raw = client.completions.with_raw_response.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            **greedy,
        )
        worker = raw.headers["x-kvbaton-worker"]
        texts: list[str] = []
        finishes: list[str] = []
        usage, before = None, ""
        for chunk in raw.parse():
            for choice in chunk.choices:
                texts.append(choice.text)
                finishes += [choice.finish_reason] if choice.finish_reason else []
            usage = chunk.usage or usage
            if len(texts) == 4:
                before = "".join(texts)
                os.kill(worker_pid(vllm_serve, worker), signal.SIGKILL)
    assert before and reference.choices[0].text.startswith(before)  # killed mid-stream
    assert finishes == ["length"]
    assert usage is not None and usage.completion_tokens == max_tokens
    assert "".join(texts).startswith(before)


def test_greedy_answers_equal_vllm_offline(
    client: openai.OpenAI, vllm_serve: Deployment, offline: list[str]
) -> None:
    served = []
    for ids in prompt_ids():
        answer = client.completions.create(
            model=vllm_serve.model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0
        )
        served.append(answer.choices[0].text)
    assert served == offline


def test_seeded_answers_with_penalties_equal_vllm_offline(
    client: openai.OpenAI, vllm_serve: Deployment
) -> None:
    """Every sampling option reaches vLLM as it was given: a seed at a temperature and the
    penalties give vLLM's offline answers (the disaggregated ones are compared with these)."""
    served = [
        client.completions.create(
            model=vllm_serve.model, prompt=ids, max_tokens=MAX_TOKENS, **SAMPLINGS["seeded"]
        )
        .choices[0]
        .text
        for ids in prompt_ids()
    ]
    assert served == offline_texts("seeded")


def test_a_constrained_stream_whose_worker_is_killed_migrates(vllm_serve: Deployment) -> None:
    """A JSON-schema stream's worker is killed after its first tokens: the other worker's vLLM
    resumes the constraint past them (kvbaton's logits processor), so the answer is whole and
    valid."""
    schema = {
        "type": "object",
        "properties": {
            "numbers": {
                "type": "array",
                "items": {"type": "integer", "minimum": 100, "maximum": 999},
                "minItems": 24,
                "maxItems": 24,
            }
        },
        "required": ["numbers"],
        "additionalProperties": False,
    }
    both_ready(vllm_serve)
    url, model = vllm_serve.url, vllm_serve.model
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "user", "content": "Give me some three-digit numbers as JSON."}],
            max_tokens=200,
            temperature=0,
            stream=True,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "numbers", "schema": schema, "strict": True},
            },
        )
        worker = raw.headers["x-kvbaton-worker"]
        texts: list[str] = []
        finishes: list[str] = []
        before = ""
        for chunk in raw.parse():
            for choice in chunk.choices:
                texts.append(choice.delta.content or "")
                finishes += [choice.finish_reason] if choice.finish_reason else []
            if len(texts) == 4:
                before = "".join(texts)
                os.kill(worker_pid(vllm_serve, worker), signal.SIGKILL)
    answer = "".join(texts)
    assert before and answer.startswith(before) and len(answer) > len(before)
    assert finishes == ["stop"]
    jsonschema.validate(json.loads(answer), schema)


def worker_pid(deployment: Deployment, instance: str) -> int:
    """The process of the worker instance `instance` (hex): file discovery keeps each lease's
    owner in its record under `.leases/` (its ttl, then its pid)."""
    root = Path(deployment.discovery.removeprefix("file://"))
    _ttl, pid = msgspec.msgpack.decode((root / ".leases" / instance).read_bytes())
    assert isinstance(pid, int)
    return pid


def test_a_json_schema_gives_valid_json(client: openai.OpenAI, vllm_serve: Deployment) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    answer = client.chat.completions.create(
        model=vllm_serve.model,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=200,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_echo_with_logprobs_gives_vllm_s_prompt_logprobs(
    client: openai.OpenAI, vllm_serve: Deployment
) -> None:
    """A prompt, then the prompt with its greedy answer's token after it, both pinned to one
    worker: the second's logprob for that token (vLLM's prompt logprobs) is the first's for its
    answer (bfloat16: close, not equal), and every prompt token but the first has one."""
    from tokenizers import Tokenizer

    ids = prompt_ids()[0]  # "The capital of France is"
    ask: dict[str, Any] = {"model": vllm_serve.model, "max_tokens": 1, "temperature": 0}
    ask |= {"logprobs": 1}
    raw = client.completions.with_raw_response.create(prompt=ids, **ask)
    pin = {"nvext": {"backend_instance_id": raw.headers["x-kvbaton-worker"]}}
    answer = raw.parse().choices[0]
    assert answer.logprobs is not None and answer.logprobs.token_logprobs is not None
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    (token,) = tokenizer.encode(answer.text, add_special_tokens=False).ids  # " Paris": one
    choice = client.completions.create(
        prompt=[*ids, token], echo=True, extra_body=pin | {"prompt_logprobs": 0}, **ask
    ).choices[0]
    scored = choice.logprobs
    assert scored is not None and scored.token_logprobs is not None
    assert scored.top_logprobs is not None
    assert len(scored.token_logprobs) == len(ids) + 2
    assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None
    expected = answer.logprobs.token_logprobs[0]
    assert scored.token_logprobs[len(ids)] == pytest.approx(expected, abs=0.05)
    for logprob, top in zip(scored.token_logprobs[1:], scored.top_logprobs[1:], strict=True):
        assert logprob is not None and top is not None and logprob <= max(top.values()) + 1e-6
    # vLLM's field beside it (its own alternatives: none asked), with vLLM's ranks.
    shown = (choice.model_extra or {})["prompt_logprobs"]
    assert shown[0] is None
    scored_ids = [*ids, token]
    for position, t, logprob in zip(
        shown[1:], scored_ids[1:], scored.token_logprobs[1 : len(scored_ids)], strict=True
    ):
        assert list(position) == [str(t)]
        assert position[str(t)]["logprob"] == pytest.approx(logprob)
        assert position[str(t)]["rank"] >= 1


def test_a_prompt_over_the_context_is_a_400(client: openai.OpenAI, vllm_serve: Deployment) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(
            model=vllm_serve.model, prompt=[42] * (MAX_MODEL_LEN + 8), max_tokens=4
        )


def test_a_repeated_prompt_reports_vllm_s_cached_tokens(
    client: openai.OpenAI, vllm_serve: Deployment
) -> None:
    """The same 300-token prompt twice at one worker: the second finds its whole blocks in
    vLLM's prefix cache (never the prompt's last token: at least one is computed). The second
    is pinned to the worker that served the first: the frontend may still list a worker an
    earlier test killed."""
    prompt = list(range(1000, 1300))
    cached = []
    pin: dict[str, Any] = {}
    for _ in range(2):
        raw = client.completions.with_raw_response.create(
            model=vllm_serve.model, prompt=prompt, max_tokens=2, extra_body=pin
        )
        pin = {"nvext": {"backend_instance_id": raw.headers["x-kvbaton-worker"]}}
        answer = raw.parse()
        assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)
        details = answer.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
    assert not cached[0]
    assert 256 <= (cached[1] or 0) < len(prompt), cached


def test_a_worker_whose_vllm_engine_core_dies_exits_and_is_started_again(
    client: openai.OpenAI, vllm_serve: Deployment
) -> None:
    both_ready(vllm_serve)
    pid = serve_slot(vllm_serve, "worker-1")["pid"]
    os.kill(named(pid)["VLLM::EngineCore"], signal.SIGKILL)
    wait_until_sync(
        lambda: serve_slot(vllm_serve, "worker-1")["pid"] != pid,
        60,
        "the worker exiting once its engine core died",
    )
    assert serve_slot(vllm_serve, "worker-1")["last_exit"] == "code 1"  # it stopped itself
    # The other worker serves meanwhile.
    answer = client.completions.create(model=vllm_serve.model, prompt="Hi", max_tokens=2)
    assert answer.choices[0].text
    wait_until_sync(
        lambda: serve_slot(vllm_serve, "worker-1")["state"] == "ready",
        READY_S,
        "serve's new worker-1",
    )


def test_a_killed_worker_leaves_no_vllm_process_or_socket(
    vllm_serve: Deployment, ipc_base: Path
) -> None:
    """Killed serving, then killed again while serve's restart of it loads vLLM's model (the
    reaper notes vLLM's processes as they start): no process, socket or temporary file of vLLM
    is left (each in the engine's directory, removed). Last in the module."""
    both_ready(vllm_serve)
    pid = serve_slot(vllm_serve, "worker-0")["pid"]
    assert "VLLM::EngineCore" in named(pid), "vLLM's engine runs in a child process"
    (ipc,) = ipc_base.glob(f"kvbaton-vllm-{pid}-*")
    assert any(path.is_socket() for path in ipc.iterdir()), "vLLM's sockets are in it"
    rendezvous = [path for path in ipc.iterdir() if path.name.startswith("vllm_dist_")]
    assert rendezvous, "and its processes' temporary files (its rendezvous file)"
    kill_and_check(pid, ipc_base)
    wait_until_sync(
        lambda: (
            (p := serve_slot(vllm_serve, "worker-0")["pid"]) != pid and "VLLM::Worker" in named(p)
        ),
        READY_S,
        "serve's new worker-0 loading vLLM's model",
    )
    kill_and_check(serve_slot(vllm_serve, "worker-0")["pid"], ipc_base)


def named(pid: int) -> dict[str, int]:
    """The process's descendants by their command's first word (vLLM names its own)."""
    found = {}
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            command = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0].decode()
            found[command] = child
    return found


def kill_and_check(pid: int, ipc_base: Path) -> None:
    """Kill the worker: its vLLM processes end, its ipc directory (in `ipc_base`) goes, and no
    socket is left outside an engine's directory."""
    children = descendants(pid)
    (ipc,) = ipc_base.glob(f"kvbaton-vllm-{pid}-*")
    os.kill(pid, signal.SIGKILL)
    wait_until_sync(
        lambda: all(start_time(c) is None for c in children) and not ipc.exists(),
        30,
        f"processes {children} or {ipc} outliving their worker",
    )
    assert not [path for path in ipc_base.iterdir() if path.is_socket()]
