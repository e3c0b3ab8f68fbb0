"""`--reasoning-parser` through the official `openai` client: a `kvbaton serve` with the flag
(which passes it to its frontend) and a second frontend without it, in front of the same
fixed-output worker, whose answer is `<think>plan</think>answer`."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import anthropic
import openai
import pytest

from kvbaton.llm.tokenizer import Tokenizer
from tests.frontend.conftest import served_beside_a_plain_frontend

pytestmark = pytest.mark.integration

ANSWER = "<think>plan</think>answer"
MESSAGES: list[Any] = [{"role": "user", "content": "Why?"}]


@dataclass
class Frontends:
    model: str
    tokens: int  # of ANSWER: the fixed engine's whole output at this max_tokens
    parsed: openai.OpenAI  # --reasoning-parser qwen3
    plain: openai.OpenAI  # no flag


@pytest.fixture(scope="module")
def frontends(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontends]:
    ids = Tokenizer(chat_model).encode(ANSWER, add_special_tokens=False)
    assert Tokenizer(chat_model).decode(ids) == ANSWER
    discovery = tmp_path_factory.mktemp("discovery")
    fixed = ",".join(map(str, ids))
    flags = ("--engine", "fixed", "--fixed-tokens", fixed, "--reasoning-parser", "qwen3")
    with served_beside_a_plain_frontend(chat_model, discovery, *flags) as (served, plain):
        yield Frontends(
            served.model,
            len(ids),
            openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0),
            openai.OpenAI(base_url=f"{plain.url}/v1", api_key="none", max_retries=0),
        )


def whole(client: openai.OpenAI, f: Frontends, **extra: Any) -> tuple[Any, str | None, str | None]:
    """(the answer, its reasoning_content, its content)."""
    out = client.chat.completions.create(
        model=f.model,
        messages=extra.pop("messages", MESSAGES),
        max_tokens=extra.pop("max_tokens", f.tokens),
        **extra,
    )
    message = out.choices[0].message
    return out, getattr(message, "reasoning_content", None), message.content


def streamed(client: openai.OpenAI, f: Frontends, **extra: Any) -> tuple[str, str, list[Any]]:
    """(the deltas' reasoning_content joined, their content joined, the chunks)."""
    chunks = list(
        client.chat.completions.create(
            model=f.model,
            messages=extra.pop("messages", MESSAGES),
            max_tokens=extra.pop("max_tokens", f.tokens),
            stream=True,
            stream_options={"include_usage": True},
            **extra,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    return reasoning, "".join(d.content or "" for d in deltas), chunks


def test_a_whole_answer_has_its_reasoning_apart(frontends: Frontends) -> None:
    out, reasoning, content = whole(frontends.parsed, frontends)
    assert (reasoning, content) == ("plan", "answer")
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == frontends.tokens


def test_streamed_deltas_carry_the_reasoning_apart(frontends: Frontends) -> None:
    reasoning, content, chunks = streamed(frontends.parsed, frontends)
    assert (reasoning, content) == ("plan", "answer")
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == frontends.tokens


def test_a_response_has_a_reasoning_item_before_its_message(frontends: Frontends) -> None:
    """The Responses API: the reasoning is an item of its own, whole and streamed."""
    ask: dict[str, Any] = {"model": frontends.model, "max_output_tokens": frontends.tokens}
    response = frontends.parsed.responses.create(input="Why?", **ask)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert [c.text for c in reasoning.content or []] == ["plan"]
    assert response.output_text == "answer"
    events = list(frontends.parsed.responses.create(input="Why?", stream=True, **ask))
    deltas = {
        kind: "".join(e.delta for e in events if e.type == f"response.{kind}.delta")
        for kind in ("reasoning_text", "output_text")
    }
    assert deltas == {"reasoning_text": "plan", "output_text": "answer"}
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output_text == "answer"


def test_reasoning_goes_back_as_encrypted_content(frontends: Frontends) -> None:
    """include reasoning.encrypted_content (what stateless clients ask, to send the reasoning
    back with the next turn): the reasoning item carries it, and the whole output goes back."""
    ask: dict[str, Any] = {"model": frontends.model, "max_output_tokens": frontends.tokens}
    ask |= {"include": ["reasoning.encrypted_content"], "store": False}
    response = frontends.parsed.responses.create(input="Why?", **ask)
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    assert base64.b64decode(reasoning.encrypted_content).decode() == "plan"
    turn = [
        {"role": "user", "content": "Why?"},
        *response.output,
        {"role": "user", "content": "Ok"},
    ]
    again = frontends.parsed.responses.create(input=cast(Any, turn), **ask)
    assert again.output_text == "answer"


def test_a_message_has_a_thinking_block_before_its_text(frontends: Frontends) -> None:
    """Anthropic's Messages API: the reasoning is a thinking block, whole and streamed; it goes
    back in the next turn's assistant message (left out of the prompt)."""
    claude = anthropic.Anthropic(
        base_url=str(frontends.parsed.base_url).removesuffix("/v1/"), api_key="x", max_retries=0
    )
    ask: dict[str, Any] = {"model": frontends.model, "max_tokens": frontends.tokens}
    ask["messages"] = [{"role": "user", "content": "Why?"}]
    message = claude.messages.create(**ask)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "plan" and message.content[1].text == "answer"
    events = list(claude.messages.create(stream=True, **ask))
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == "plan"
    assert "".join(d.text for d in deltas if d.type == "text_delta") == "answer"
    with claude.messages.stream(**ask) as stream:
        helped = stream.get_final_message()
    assert [b.type for b in helped.content] == ["thinking", "text"]
    turn = [
        *ask["messages"],
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {"role": "user", "content": "Ok"},
    ]
    again = claude.messages.create(**ask | {"messages": turn})
    assert again.content[-1].text == "answer"
    omitted = claude.messages.create(
        **ask, thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    )
    assert [(b.type, getattr(b, "thinking", None)) for b in omitted.content[:1]] == [
        ("thinking", "")
    ]
    assert omitted.content[1].text == "answer"


def test_without_the_flag_the_tags_stay_in_the_content(frontends: Frontends) -> None:
    out, reasoning, content = whole(frontends.plain, frontends)
    assert (reasoning, content) == (None, ANSWER)
    assert "reasoning_content" not in (out.choices[0].message.model_extra or {})
    reasoning, content, _ = streamed(frontends.plain, frontends)
    assert (reasoning, content) == ("", ANSWER)


def test_stop_strings_apply_to_the_whole_text(frontends: Frontends) -> None:
    out, reasoning, content = whole(frontends.parsed, frontends, stop=["swer"])
    assert (reasoning, content, out.choices[0].finish_reason) == ("plan", "an", "stop")
    out, reasoning, content = whole(frontends.parsed, frontends, stop=["an"])
    assert (reasoning, content, out.choices[0].finish_reason) == ("pl", "", "stop")
    reasoning, content, chunks = streamed(frontends.parsed, frontends, stop=["swer"])
    assert (reasoning, content, chunks[-2].choices[0].finish_reason) == ("plan", "an", "stop")


def test_an_answer_cut_inside_its_reasoning(frontends: Frontends) -> None:
    out, reasoning, content = whole(frontends.parsed, frontends, max_tokens=9)  # "<think>pl"
    assert (reasoning, content, out.choices[0].finish_reason) == ("pl", "", "length")


def test_a_continued_message_goes_on_where_its_text_left_off(frontends: Frontends) -> None:
    """The answer continues the final message: inside the reasoning if that message left it
    open, in the content if it closed it (the answer's own tags are then text)."""
    for started, parts in [
        ("<think>Let me see.", ("<think>plan", "answer")),
        ("<think>seen</think>So:", (None, ANSWER)),
    ]:
        messages = [*MESSAGES, {"role": "assistant", "content": started}]
        _, *split = whole(
            frontends.parsed,
            frontends,
            messages=messages,
            extra_body={"continue_final_message": True},
        )
        assert tuple(split) == parts
        reasoning, content, _ = streamed(
            frontends.parsed,
            frontends,
            messages=messages,
            extra_body={"continue_final_message": True},
        )
        assert (reasoning or None, content) == parts


def test_text_completions_are_not_split(frontends: Frontends) -> None:
    out = frontends.parsed.completions.create(
        model=frontends.model, prompt="Why?", max_tokens=frontends.tokens
    )
    assert out.choices[0].text == ANSWER
