"""The OpenAI API of a real `kvbaton serve`, through the official `openai` client (sync and
async, streaming and not) and raw HTTP where the client would hide what is checked."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from kvbaton.llm.tokenizer import Tokenizer
from kvbaton.planner.observer import parse_totals
from tests.frontend.conftest import Deployment

pytestmark = pytest.mark.integration

GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def client(served: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)


@pytest.fixture
def aclient(served: Deployment) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(chat_model: Path) -> Tokenizer:
    return Tokenizer(chat_model)


def test_chat_sync_with_usage_from_the_tokenizer(
    client: openai.OpenAI, served: Deployment, tokenizer: Tokenizer
) -> None:
    out = client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=12, **GREEDY
    )
    assert out.object == "chat.completion"
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(tokenizer.apply_chat_template(MESSAGES))
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_chat_streaming_matches_the_whole_answer(client: openai.OpenAI, served: Deployment) -> None:
    whole = client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=20, **GREEDY
    )
    chunks = list(
        client.chat.completions.create(
            model=served.model,
            messages=MESSAGES,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore[union-attr]


async def test_async_client_streaming_and_not(
    aclient: openai.AsyncOpenAI, served: Deployment
) -> None:
    async with aclient:
        whole = await aclient.chat.completions.create(
            model=served.model, messages=MESSAGES, max_tokens=10, **GREEDY
        )
        stream = await aclient.chat.completions.create(
            model=served.model, messages=MESSAGES, max_tokens=10, stream=True, **GREEDY
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.completion_tokens == 10


def test_completions_string_list_and_token_ids(
    client: openai.OpenAI, served: Deployment, tokenizer: Tokenizer
) -> None:
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    one = client.completions.create(model=served.model, prompt=prompt, max_tokens=8, **GREEDY)
    assert one.object == "text_completion"
    assert one.usage is not None and one.usage.prompt_tokens == len(ids)
    assert one.usage.completion_tokens == 8
    by_ids = client.completions.create(model=served.model, prompt=ids, max_tokens=8, **GREEDY)
    assert by_ids.choices[0].text == one.choices[0].text
    many = client.completions.create(
        model=served.model, prompt=[prompt, "Once upon a time"], max_tokens=8, **GREEDY
    )
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == one.choices[0].text
    assert many.usage is not None and many.usage.completion_tokens == 16
    streamed = client.completions.create(
        model=served.model, prompt=prompt, max_tokens=8, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed) == one.choices[0].text


def test_stop_string_that_spans_tokens_never_leaks(
    client: openai.OpenAI, served: Deployment
) -> None:
    prompt = "Once upon a time"
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model=served.model, prompt=prompt, max_tokens=40, stream=True, **GREEDY
        )
    ]
    text = "".join(pieces)
    # A stop string made of the end of one token's text and the start of the next one's.
    k = next(
        i
        for i in range(len(pieces) - 1)
        if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2 and "\ufffd" not in pieces[i]
    )
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    expected = text[: text.find(stop)]
    for stream in (False, True):
        out = client.completions.create(
            model=served.model, prompt=prompt, max_tokens=40, stop=[stop], stream=stream, **GREEDY
        )
        if stream:
            chunks = list(out)  # type: ignore[arg-type]
            got = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            got, finish = out.choices[0].text, out.choices[0].finish_reason  # type: ignore[union-attr]
        assert got == expected
        assert finish == "stop"


def test_seed_makes_sampling_reproducible(client: openai.OpenAI, served: Deployment) -> None:
    def sample(seed: int) -> str:
        out = client.chat.completions.create(
            model=served.model,
            messages=MESSAGES,
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return out.choices[0].message.content or ""

    assert sample(7) == sample(7)
    assert len({sample(1), sample(2), sample(3)}) > 1


def test_logprobs_in_both_shapes(client: openai.OpenAI, served: Deployment) -> None:
    chat = client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    text = client.completions.create(
        model=served.model, prompt="Hello", max_tokens=4, logprobs=2, **GREEDY
    )
    lp = text.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and len(lp.token_logprobs) == 4
    assert lp.top_logprobs is not None and all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.tokens is not None and lp.text_offset == text_offsets(lp.tokens)


def text_offsets(tokens: list[str]) -> list[int]:
    """Where each token's text starts in their text joined (vLLM's `text_offset`)."""
    return list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))


def cached_tokens(usage: Any) -> int:
    details = usage.prompt_tokens_details if usage is not None else None
    return (details.cached_tokens or 0) if details is not None else 0


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_cache_salt_keeps_each_tenant_s_prefix_cache_apart(
    client: openai.OpenAI, served: Deployment, route: str
) -> None:
    prompt = f"A {route} prompt long enough to fill a few KV blocks of its own, twice over. " * 2

    def cached(salt: str | None) -> int:
        extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt is not None else {})
        if route == "chat":
            out: Any = client.chat.completions.create(
                model=served.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=2,
                temperature=0,
                extra_body=extra,
            )
        else:
            out = client.completions.create(
                model=served.model, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
            )
        return cached_tokens(out.usage)

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0  # the same tenant reuses its own prefix
    assert cached("tenant-b") == 0  # another tenant never sees it
    assert cached(None) == 0  # nor does a request without a salt
    assert cached("tenant-b") > 0


def test_bad_cache_salt_is_a_400_naming_it(client: openai.OpenAI, served: Deployment) -> None:
    for salt in ("", 42, {"tenant": "a"}):
        with pytest.raises(openai.BadRequestError, match="cache_salt") as raised:
            client.chat.completions.create(
                model=served.model,
                messages=MESSAGES,
                max_tokens=1,
                extra_body={"cache_salt": salt},
            )
        assert raised.value.status_code == 400
        assert raised.value.body["param"] == "cache_salt"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="cache_salt: must be a non-empty string"):
        client.completions.create(
            model=served.model, prompt="x", max_tokens=1, extra_body={"cache_salt": ""}
        )


def test_logit_bias_steers_each_token(
    client: openai.OpenAI, served: Deployment, tokenizer: Tokenizer
) -> None:
    prompt = "The capital of France is"
    favoured = tokenizer.encode(" zebra")[-1]
    steered = client.completions.create(
        model=served.model,
        prompt=prompt,
        max_tokens=4,
        logit_bias={str(favoured): 100},
        **GREEDY,
    )
    assert steered.choices[0].text == tokenizer.decode([favoured] * 4)
    chat = client.chat.completions.create(
        model=served.model,
        messages=MESSAGES,
        max_tokens=3,
        logit_bias={str(favoured): 100},
        **GREEDY,
    )
    assert chat.choices[0].message.content == tokenizer.decode([favoured] * 3)


def test_models_health_live_metrics_openapi(served: Deployment) -> None:
    with httpx.Client(base_url=served.url) as http:
        models = http.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [served.model]
        assert http.get(f"/v1/models/{served.model}").json()["id"] == served.model
        missing = http.get("/v1/models/nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        health = http.get("/health").json()
        assert health["status"] == "healthy" and len(health["models"][served.model]) == 1
        assert http.get("/live").status_code == 200
        assert "/v1/chat/completions" in http.get("/openapi.json").json()["paths"]
        http.post("/v1/completions", json={"model": served.model, "prompt": "Hi", "max_tokens": 3})
        metrics = http.get("/metrics").text
    for name in (
        "kvbaton_frontend_requests_total",
        "kvbaton_frontend_inflight_requests",
        "kvbaton_frontend_time_to_first_token_seconds_bucket",
        "kvbaton_frontend_inter_token_latency_seconds_bucket",
        "kvbaton_frontend_input_tokens_total",
        "kvbaton_frontend_output_tokens_total",
        "kvbaton_frontend_request_duration_seconds_bucket",
        "kvbaton_frontend_input_sequence_tokens_bucket",
        "kvbaton_frontend_output_sequence_tokens_bucket",
    ):
        assert f"{name}{{" in metrics, name
    assert 'route="completions",status="200"' in metrics


def test_each_completed_request_s_lengths_are_exported(served: Deployment) -> None:
    """Per-request prompt and output lengths (the planner's means); a refused request counts
    as a request, with its status, but has no lengths."""
    with httpx.Client(base_url=served.url) as http:
        before = parse_totals(http.get("/metrics").text, served.model, 0.0)
        ok = {"model": served.model, "prompt": [20, 21, 22, 23, 24], "max_tokens": 3}
        r = http.post("/v1/completions", json={**ok, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        too_long = {**ok, "prompt": [20] * 10_000}
        assert http.post("/v1/completions", json=too_long).status_code == 400
        after = parse_totals(http.get("/metrics").text, served.model, 0.0)
    assert (after.isl_count - before.isl_count, after.isl_sum - before.isl_sum) == (1, 5)
    assert (after.osl_count - before.osl_count, after.osl_sum - before.osl_sum) == (1, 3)
    assert after.requests - before.requests == 2


def test_request_id_is_echoed_and_reaches_the_worker_log(served: Deployment) -> None:
    with httpx.Client(base_url=served.url) as http:
        r = http.post(
            "/v1/completions",
            json={"model": served.model, "prompt": "Hi", "max_tokens": 2},
            headers={"x-request-id": "trace-me-42"},
        )
        assert r.headers["x-request-id"] == "trace-me-42"
        assert r.json()["id"] == "cmpl-trace-me-42"
        generated = http.get("/live").headers["x-request-id"]
        assert len(generated) == 32
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any("[worker-0]" in line and "trace-me-42" in line for line in served.lines):
            return
        time.sleep(0.1)
    raise AssertionError("the worker never logged the request id:\n" + served.log_text())


USER = [{"role": "user", "content": "x"}]
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
IMAGE_MESSAGE = [{"role": "user", "content": [IMAGE]}]  # refused: text parts only
BAD_NAME = [{"type": "function", "function": {"name": "a b"}}]  # a space: not a name


def chat(**fields: Any) -> dict[str, Any]:
    """A chat body for the served model ("M" stands for it) with `fields` on top."""
    return {"model": "M", "messages": USER} | fields


BAD_REQUESTS: list[tuple[str, Any, int, str | None]] = [
    # (route, body, status, param)
    ("chat/completions", "{not json", 400, None),
    ("chat/completions", [1, 2], 400, None),
    ("chat/completions", {"messages": USER}, 400, "model"),
    ("chat/completions", chat(model="nope"), 404, "model"),
    ("chat/completions", chat(messages=[]), 400, "messages"),
    ("chat/completions", chat(messages="hi"), 400, "messages"),
    ("chat/completions", chat(messages=[{"role": "wiz", "content": "x"}]), 400, "messages.0.role"),
    ("chat/completions", chat(messages=IMAGE_MESSAGE), 400, "messages.0.content"),
    ("chat/completions", chat(messages=[{"role": "user", "content": "x " * 400}]), 400, "messages"),
    ("chat/completions", chat(temperature="hot"), 400, "temperature"),
    ("chat/completions", chat(temperature=3), 400, "temperature"),
    ("chat/completions", chat(top_p=0), 400, "top_p"),
    ("chat/completions", chat(max_tokens=0), 400, "max_tokens"),
    ("completions", {"model": "M", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": "M", "prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("chat/completions", chat(prompt_logprobs=-1), 400, "prompt_logprobs"),
    ("chat/completions", chat(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    ("completions", {"model": "M", "prompt": "x", "max_tokens": -1, "echo": True}, 400,
     "max_tokens"),
    ("chat/completions", chat(max_tokens=100000), 400, "max_tokens"),
    ("chat/completions", chat(n=17), 400, "n"),
    ("chat/completions", chat(tools=BAD_NAME), 400, "tools.0.function.name"),
    ("chat/completions", chat(response_format={"type": "yaml"}), 400, "response_format"),
    ("chat/completions", chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat/completions", chat(min_tokens=9, max_tokens=3), 400, "min_tokens"),
    ("chat/completions", chat(seed=2**64), 400, "seed"),
    ("chat/completions", chat(top_k=2**64), 400, "top_k"),
    ("chat/completions", chat(stop_token_ids=[999999]), 400, "stop_token_ids"),
    ("completions", {"model": "M", "prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("chat/completions", chat(stop=""), 400, "stop"),
    ("chat/completions", chat(stop=["a", ""]), 400, "stop"),
    ("chat/completions", chat(frobnicate=1), 400, "frobnicate"),
    ("chat/completions", chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("chat/completions", chat(logit_bias={"999999": 1}), 400, "logit_bias"),
    ("chat/completions", chat(logit_bias={"5": 101}), 400, "logit_bias"),
    ("completions", {"model": "M", "prompt": "x", "logit_bias": {"-1": 5}}, 400, "logit_bias"),
    ("chat/completions", chat(chat_template_kwargs={"tools": []}), 400, "chat_template_kwargs"),
    ("chat/completions", chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
    ("chat/completions", chat(continue_final_message=True, add_generation_prompt=True), 400,
     "continue_final_message"),
    ("chat/completions", chat(reasoning_effort="extreme"), 400, "reasoning_effort"),
    ("chat/completions", chat(verbosity="low"), 400, "verbosity"),
    ("chat/completions", chat(verbosity="loud"), 400, "verbosity"),
    ("chat/completions", chat(cache_salt=""), 400, "cache_salt"),
    ("chat/completions", chat(cache_salt=7), 400, "cache_salt"),
    ("completions", {"model": "M", "prompt": "x", "cache_salt": ["a"]}, 400, "cache_salt"),
    ("completions", {"model": "M", "prompt": []}, 400, "prompt"),
    ("completions", {"model": "M", "prompt": [999999]}, 400, "prompt"),
    ("completions", {"model": "M", "prompt": "x", "logprobs": 99}, 400, "logprobs"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD_REQUESTS)
def test_bad_input_gets_its_4xx_in_openai_shape(
    served: Deployment, route: str, body: Any, status: int, param: str | None
) -> None:
    if isinstance(body, dict) and body.get("model") == "M":
        body = body | {"model": served.model}
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        f"{served.url}/v1/{route}",
        content=content,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


def test_an_assistant_message_is_continued(
    client: openai.OpenAI, served: Deployment, tokenizer: Tokenizer
) -> None:
    started = [*MESSAGES, {"role": "assistant", "content": "The capital is"}]
    out = client.chat.completions.create(
        model=served.model,
        messages=started,
        max_tokens=4,
        extra_body={"continue_final_message": True, "chat_template_kwargs": {"unused": 1}},
    )
    continued = tokenizer.apply_chat_template(
        started, add_generation_prompt=False, continue_final_message=True
    )
    assert tokenizer.decode(continued, skip_special_tokens=False).endswith("The capital is")
    assert out.usage is not None and out.usage.prompt_tokens == len(continued)


def test_echo_puts_each_prompt_before_its_answers(
    client: openai.OpenAI, served: Deployment, tokenizer: Tokenizer
) -> None:
    prompts = ["Paris is", "The capital of Rome"]
    ask: dict[str, Any] = {"model": served.model, "max_tokens": 4, "n": 2, **GREEDY}
    plain = client.completions.create(prompt=prompts, **ask)
    echoed = client.completions.create(prompt=prompts, echo=True, **ask)
    assert [c.index for c in echoed.choices] == [0, 1, 2, 3]
    for mine, theirs in zip(echoed.choices, plain.choices, strict=True):
        assert mine.text == prompts[mine.index // 2] + theirs.text
    assert echoed.usage == plain.usage  # the echo is not counted as output
    streamed = client.completions.create(prompt=prompts, echo=True, stream=True, **ask)
    texts = ["", "", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in echoed.choices]
    # A prompt of token ids is echoed as their text; stop strings do not apply to the echo.
    ids = tokenizer.encode("Paris is")
    by_ids = client.completions.create(prompt=ids, echo=True, **ask | {"n": 1}, stop=["Paris"])
    assert by_ids.choices[0].text.startswith(tokenizer.decode(ids))
    assert by_ids.usage is not None and by_ids.usage.completion_tokens > 0


def test_echo_with_logprobs_scores_the_prompt(
    client: openai.OpenAI, served: Deployment, tokenizer: Tokenizer, chat_model: Path
) -> None:
    """lm-evaluation-harness's loglikelihood request (token ids, echo, logprobs 1, max_tokens 1):
    each prompt's tokens come first, the first with null logprob and alternatives, the others
    with the model's own logprobs (HF transformers on the same weights, float32), then the
    answer's, as without echo; computed whole though the prefix cache holds the prompt."""
    texts = ("The capital of France is Paris, and the capital of Italy is " * 3, "Rome is")
    prompts = [tokenizer.encode(t) for t in texts]  # the first over two KV blocks
    ask: dict[str, Any] = {"model": served.model, "max_tokens": 1, "temperature": 0, "logprobs": 1}
    plain = client.completions.create(prompt=prompts, **ask)  # and the prefix cache holds them
    echoed = client.completions.create(prompt=prompts, echo=True, **ask)
    streamed = list(client.completions.create(prompt=prompts, echo=True, stream=True, **ask))
    for ids, mine, theirs in zip(prompts, echoed.choices, plain.choices, strict=True):
        lp, answer = mine.logprobs, theirs.logprobs
        assert lp is not None and lp.tokens is not None and answer is not None
        assert lp.token_logprobs is not None and lp.top_logprobs is not None
        n = len(ids)
        assert lp.tokens == [
            tokenizer.backend.decode([t], skip_special_tokens=False) for t in ids
        ] + (answer.tokens or [])
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = hf_logprobs(chat_model, ids)
        wanted = [float(expected[i, ids[i + 1]]) for i in range(n - 1)]
        assert lp.token_logprobs[1:n] == pytest.approx(wanted, abs=1e-3)
        best = [max(top.values()) for top in lp.top_logprobs[1:n]]  # type: ignore[union-attr]
        assert best == pytest.approx(expected.max(dim=-1).values.tolist(), abs=1e-3)
        assert lp.token_logprobs[n:] == pytest.approx(answer.token_logprobs, abs=1e-4)
        assert mine.text == tokenizer.decode(ids) + theirs.text
        parts = [
            c.choices[0].logprobs
            for c in streamed
            if c.choices and c.choices[0].index == mine.index
        ]
        assert [t for part in parts if part for t in part.tokens or []] == lp.tokens
        assert [o for part in parts if part for o in part.text_offset or []] == lp.text_offset
        assert lp.text_offset == text_offsets(lp.tokens)
    assert echoed.usage == plain.usage
    again = client.completions.create(prompt=prompts, **ask)
    assert cached_tokens(echoed.usage) == 0 and cached_tokens(again.usage) > 0
    # max_tokens 0 (vLLM's): the prompt alone, with the same logprobs, and no answer counted.
    alone = client.completions.create(
        prompt=prompts, echo=True, **ask | {"max_tokens": 0, "extra_body": {"ignore_eos": True}}
    )
    for ids, mine, whole in zip(prompts, alone.choices, echoed.choices, strict=True):
        assert mine.text == tokenizer.decode(ids)
        assert mine.finish_reason == "length"
        assert mine.logprobs is not None and whole.logprobs is not None
        assert mine.logprobs.tokens == (whole.logprobs.tokens or [])[: len(ids)]
        assert mine.logprobs.token_logprobs == (whole.logprobs.token_logprobs or [])[: len(ids)]
    assert alone.usage is not None and alone.usage.completion_tokens == 0
    assert alone.usage.prompt_tokens == sum(len(ids) for ids in prompts)
    chunks = client.completions.create(
        prompt=prompts[1], echo=True, stream=True, **ask | {"max_tokens": 0}
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tokenizer.decode(prompts[1])


def hf_logprobs(chat_model: Path, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: the model's log-softmax before each prompt token after the first
    (HF transformers on the served weights, float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_prompt_logprobs_as_vllm_gives_them(
    client: openai.OpenAI, served: Deployment, tokenizer: Tokenizer, chat_model: Path
) -> None:
    """vLLM's `prompt_logprobs` field: per completion choice, and on a whole chat response; per
    prompt token after the first (null), its own logprob and rank and the best alternatives,
    keyed by token id, each with its text."""
    ids = tokenizer.encode("Paris is the capital of France, and Rome is")
    ask: dict[str, Any] = {"model": served.model, "max_tokens": 3, "temperature": 0}
    plain = client.completions.create(prompt=ids, **ask)
    scored = client.completions.create(prompt=ids, extra_body={"prompt_logprobs": 2}, **ask)
    (choice,) = scored.choices
    assert choice.text == plain.choices[0].text and choice.logprobs is None
    shown = (choice.model_extra or {})["prompt_logprobs"]
    expected = hf_logprobs(chat_model, ids)
    assert len(shown) == len(ids) and shown[0] is None
    for i, position in enumerate(shown[1:]):
        row, token = expected[i], ids[i + 1]
        mine = position[str(token)]
        assert mine["logprob"] == pytest.approx(float(row[token]), abs=1e-3)
        above, near = int((row > row[token] + 1e-4).sum()), int((row >= row[token] - 1e-4).sum())
        assert above < mine["rank"] <= near  # how many are at least as likely (vLLM's rank)
        assert mine["decoded_token"] == tokenizer.backend.decode([token], skip_special_tokens=False)
        best = row.topk(2).indices.tolist()
        assert [position[str(t)]["rank"] for t in best] == [1, 2]
        assert len(position) == 2 + (token not in best)
    chat = client.chat.completions.create(
        messages=MESSAGES, extra_body={"prompt_logprobs": 0}, n=2, **ask
    )
    prompt = tokenizer.apply_chat_template(MESSAGES)
    shown = (chat.model_extra or {})["prompt_logprobs"]
    assert len(shown) == len(prompt) and shown[0] is None
    assert [list(p) for p in shown[1:]] == [[str(t)] for t in prompt[1:]]


ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def test_tokenize_gives_the_ids_a_request_is_given(
    client: openai.OpenAI, served: Deployment, tokenizer: Tokenizer
) -> None:
    def tokenize(**body: Any) -> dict[str, Any]:
        r = httpx.post(f"{served.url}/tokenize", json={"model": served.model} | body)
        assert r.status_code == 200, r.text
        answer: dict[str, Any] = r.json()
        assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] > 0
        return answer

    text = tokenize(prompt="Paris is", return_token_strs=True)
    assert text["tokens"] == tokenizer.encode("Paris is")
    assert "".join(text["token_strs"]).replace("\u0120", " ") == "Paris is"  # byte-level BPE
    asked = client.completions.create(model=served.model, prompt="Paris is", max_tokens=1)
    assert asked.usage is not None and asked.usage.prompt_tokens == text["count"]

    chat = tokenize(messages=MESSAGES)
    assert chat["token_strs"] is None
    answered = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=1)
    assert answered.usage is not None and answered.usage.prompt_tokens == chat["count"]
    # The official client's reasoning_effort is taken (this model's template does not use it).
    low = tokenize(messages=MESSAGES, reasoning_effort="low")
    assert low["tokens"] == chat["tokens"]
    answered = client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=1, reasoning_effort="low"
    )
    assert answered.usage is not None and answered.usage.prompt_tokens == low["count"]
    r = httpx.post(
        f"{served.url}/detokenize", json={"model": served.model, "tokens": chat["tokens"]}
    )
    assert r.status_code == 200
    assert r.json()["prompt"] == tokenizer.decode(chat["tokens"], skip_special_tokens=False)
    assert MESSAGES[-1]["content"] in r.json()["prompt"]


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        ("tokenize", {"prompt": "x", "messages": USER}, 400, "prompt"),
        ("tokenize", {}, 400, "prompt"),
        ("tokenize", {"prompt": "x", "tools": [ADD_TOOL]}, 400, "tools"),
        ("tokenize", {"messages": USER, "add_special_tokens": True}, 400, "add_special_tokens"),
        ("tokenize", {"prompt": "x", "reasoning_effort": "low"}, 400, "reasoning_effort"),
        ("tokenize", {"messages": USER, "chat_template_kwargs": {"tools": 1}}, 400,
         "chat_template_kwargs"),
        ("tokenize", {"messages": USER, "tools": [ADD_TOOL, ADD_TOOL]}, 400, "tools"),
        ("tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("detokenize", {"tokens": "x"}, 400, "tokens"),
        ("detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ],
)  # fmt: skip
def test_bad_token_route_input_gets_its_4xx(
    served: Deployment, route: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    r = httpx.post(f"{served.url}/{route}", json={"model": served.model} | body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_nulls_stand_for_the_defaults(client: openai.OpenAI, served: Deployment) -> None:
    """Clients send null for the fields they leave unset, as OpenAI's API allows."""
    unset = {"n": None, "stream": None, "ignore_eos": None, "min_tokens": None}
    chat_nulls = unset | {"logprobs": None, "parallel_tool_calls": None}
    ask = {"model": served.model, "max_tokens": 6, "temperature": 0}
    chat = client.chat.completions.create(messages=MESSAGES, **ask, extra_body=chat_nulls)
    assert chat.object == "chat.completion"  # not streamed
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None
    plain = client.chat.completions.create(messages=MESSAGES, **ask)
    assert chat.choices[0].message.content == plain.choices[0].message.content
    text = client.completions.create(prompt="Paris is", **ask, extra_body=unset | {"echo": None})
    assert text.object == "text_completion" and len(text.choices) == 1
    assert not text.choices[0].text.startswith("Paris is")  # not echoed


def test_hints_and_identifiers_are_taken(client: openai.OpenAI, served: Deployment) -> None:
    """The client's fields that name the caller or hint at OpenAI's caching and storage change
    nothing: the answer is the plain request's."""
    ask: dict[str, Any] = {"model": served.model, "messages": MESSAGES, "max_tokens": 6}
    ask["temperature"] = 0
    plain = client.chat.completions.create(**ask)
    hinted = client.chat.completions.create(
        **ask,
        prompt_cache_key="session-1",
        prompt_cache_retention="24h",
        safety_identifier="user-hash",
        user="someone",
        store=False,
        metadata={"k": "v"},
        service_tier="auto",
        verbosity="medium",
        extra_body={"prompt_cache_options": {"ttl": "1h"}},
    )
    assert hinted.choices[0].message.content == plain.choices[0].message.content


def test_body_over_the_limit_gets_413(served: Deployment) -> None:
    big = {"model": served.model, "prompt": "x" * (9 << 20)}
    r = httpx.post(f"{served.url}/v1/completions", json=big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_openai_client_raises_typed_errors(client: openai.OpenAI, served: Deployment) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.chat.completions.create(
            model=served.model,
            messages=MESSAGES,
            functions=[{"name": "f", "parameters": {}}],  # the deprecated form of tools
        )
