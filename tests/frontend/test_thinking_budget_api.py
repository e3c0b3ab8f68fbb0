"""Thinking budgets through the official clients, on `kvbaton serve --reasoning-parser
deepseek-r1` (the answer starts inside the reasoning) and its own engine on a tiny random
model whose `<think>` and `</think>` are one token each: chat's `thinking_token_budget`
(vLLM's name) and Anthropic's `thinking.budget_tokens` end the reasoning after that many
tokens, and the answer goes on after it; a frontend without a reasoning parser refuses chat's,
and goes on without Anthropic's."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest

from tests.frontend.conftest import served_beside_a_plain_frontend
from tests.tiny_models import THINKING_TEMPLATE, build_chat_model

pytestmark = pytest.mark.integration

ASK: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Why?"}],
    "temperature": 0,
    "extra_body": {"ignore_eos": True},
}


@dataclass
class Frontends:
    model: str
    parsed: openai.OpenAI  # --reasoning-parser deepseek-r1
    plain: openai.OpenAI  # no flag


@pytest.fixture(scope="module")
def frontends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontends]:
    model = build_chat_model(
        tmp_path_factory.mktemp("models") / "tiny-think",
        template=THINKING_TEMPLATE,
        added_tokens=["<think>", "</think>"],
    )
    discovery = tmp_path_factory.mktemp("discovery")
    flags = ("--reasoning-parser", "deepseek-r1")
    with served_beside_a_plain_frontend(model, discovery, *flags) as (served, plain):
        yield Frontends(
            served.model,
            openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0),
            openai.OpenAI(base_url=f"{plain.url}/v1", api_key="none", max_retries=0),
        )


def claude_of(client: openai.OpenAI) -> anthropic.Anthropic:
    base = str(client.base_url).removesuffix("/v1/")
    return anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)


def reasoning_of(f: Frontends, tokens: int) -> str:
    """The model's first `tokens` tokens, all reasoning (it writes no closing tag in so few).

    - Text that ends inside a character: its last bytes are left out here, where the answer
      ends; an answer that goes on shows them as U+FFFD (`shown`)."""
    out = f.parsed.chat.completions.create(model=f.model, max_tokens=tokens, **ASK)
    message = out.choices[0].message
    assert not message.content, message.content
    reasoning = getattr(message, "reasoning_content", None)
    assert reasoning, out
    return str(reasoning)


def shown(text: object) -> str:
    """`text` with the U+FFFD of its last character's incomplete bytes left out."""
    assert isinstance(text, str), text
    return text.rstrip("\ufffd")


def test_a_chat_answers_reasoning_ends_at_its_budget(frontends: Frontends) -> None:
    f = frontends
    ask = ASK | {"extra_body": ASK["extra_body"] | {"thinking_token_budget": 3}}
    out = f.parsed.chat.completions.create(model=f.model, max_tokens=24, **ask)
    message = out.choices[0].message
    assert shown(getattr(message, "reasoning_content", None)) == reasoning_of(f, 3)
    assert message.content  # the answer went on after the placed closing tag
    assert out.usage is not None and out.usage.completion_tokens == 24
    chunks = list(
        f.parsed.chat.completions.create(model=f.model, max_tokens=24, stream=True, **ask)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert shown(streamed) == reasoning_of(f, 3)
    assert "".join(d.content or "" for d in deltas) == message.content


def test_a_budget_places_nothing_where_the_template_closed_the_thinking(
    frontends: Frontends,
) -> None:
    f = frontends
    off = ASK | {
        "extra_body": ASK["extra_body"] | {"chat_template_kwargs": {"enable_thinking": False}}
    }
    free = f.parsed.chat.completions.create(model=f.model, max_tokens=8, **off)
    off["extra_body"] = off["extra_body"] | {"thinking_token_budget": 2}
    budgeted = f.parsed.chat.completions.create(model=f.model, max_tokens=8, **off)
    assert budgeted.choices[0].message == free.choices[0].message  # no tag placed


def test_an_anthropic_thinking_budget_ends_the_thinking_block(frontends: Frontends) -> None:
    f = frontends
    message = claude_of(f.parsed).messages.create(
        model=f.model,
        max_tokens=24,
        messages=[{"role": "user", "content": "Why?"}],
        thinking={"type": "enabled", "budget_tokens": 2},
        extra_body={"temperature": 0},  # (this client's typing refuses it beside thinking)
    )
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert shown(message.content[0].thinking) == reasoning_of(f, 2)


def test_without_a_reasoning_parser_chat_refuses_a_budget_anthropic_goes_on(
    frontends: Frontends,
) -> None:
    f = frontends
    ask = ASK | {"extra_body": {"thinking_token_budget": 3}}
    with pytest.raises(openai.BadRequestError) as refused:
        f.plain.chat.completions.create(model=f.model, max_tokens=8, **ask)
    assert refused.value.body["param"] == "thinking_token_budget"  # type: ignore[index]
    message = claude_of(f.plain).messages.create(
        model=f.model,
        max_tokens=8,
        messages=[{"role": "user", "content": "Why?"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert message.stop_reason in ("end_turn", "max_tokens")
