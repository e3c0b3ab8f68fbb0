"""What agents ask of `kvbaton serve` on its default model, SmolLM2-135M (slow: pulled and
loaded once for the module), through the official `openai` client: schema answers that parse
and validate, forced tool calls whose arguments validate against the tool's schema, a streamed
call, `json_object`, a conversation carrying a tool's result, and `n` choices whole and
streamed. The schemas bound their strings, so that a 135M model cannot ramble to
`max_tokens`."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal, TypeVar

import jsonschema
import openai
import pydantic
import pytest

from kvbaton.llm.model_files import pull
from tests.frontend.conftest import Deployment, start_serve, stop_cleanly

pytestmark = [pytest.mark.slow, pytest.mark.integration]

T = TypeVar("T")
Short = Annotated[str, pydantic.StringConstraints(max_length=16)]


class City(pydantic.BaseModel):
    name: Short
    country: Short
    population_millions: Annotated[float, pydantic.Field(ge=0, le=50)]
    climate: Literal["cold", "mild", "hot"]


PROMPTS = [
    "Describe Paris.",
    "Tell me about Tokyo.",
    "What is Cairo like?",
    "Give me facts about Oslo.",
    "Describe the city of Lima.",
    "Summarise Sydney.",
    "What do you know about Toronto?",
    "Describe Nairobi in brief.",
    "Tell me about Mumbai.",
    "Facts about Reykjavik, please.",
]
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CONVERT: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "convert_currency",
        "description": "Convert an amount of money",
        "parameters": {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "minimum": 0, "maximum": 1000000},
                "source": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "target": {"type": "string", "pattern": "^[A-Z]{3}$"},
            },
            "required": ["amount", "source", "target"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CONVERT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = [
    "What is the weather in Paris?",
    "How many yen is 20 dollars?",
    "Is it raining in London?",
    "Convert 100 EUR to USD.",
    "Do I need a coat in Oslo today?",
    "What are 5 pounds in euros?",
    "How hot is it in Cairo?",
    "Change 42 CHF into JPY.",
    "Weather for Lima, please.",
    "What is 1000 INR in GBP?",
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    model = pull("smollm2", progress=lambda line: None)
    deployment = start_serve(model, tmp_path_factory.mktemp("discovery"))
    yield deployment
    stop_cleanly(deployment)


@pytest.fixture(scope="module")
def client(smollm2: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm2.url}/v1", api_key="none", max_retries=0)


def _valid(call: Any) -> None:
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def at_once(ask: Callable[[str], T], prompts: list[str]) -> list[tuple[str, T]]:
    """Each prompt with its answer, all asked at the same time (the worker batches them)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(zip(prompts, pool.map(ask, prompts), strict=True))


def test_parse_validates_on_ten_prompts(client: openai.OpenAI, smollm2: Deployment) -> None:
    def ask(prompt: str) -> Any:
        return client.chat.completions.parse(
            model=smollm2.model,
            messages=[{"role": "user", "content": prompt}],
            response_format=City,
            max_tokens=100,
            temperature=0,
        )

    for prompt, answer in at_once(ask, PROMPTS):
        assert answer.choices[0].finish_reason == "stop", prompt
        assert isinstance(answer.choices[0].message.parsed, City), prompt


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_validate_on_ten_prompts(
    client: openai.OpenAI, smollm2: Deployment, choice: str
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}

    def ask(question: str) -> Any:
        return client.chat.completions.create(
            model=smollm2.model,
            messages=[{"role": "user", "content": question}],
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=named if choice == "named" else "required",  # type: ignore[arg-type]
            parallel_tool_calls=False,
            max_tokens=100,
            temperature=0,
        )

    for question, answer in at_once(ask, QUESTIONS):
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == ("stop" if choice == "named" else "tool_calls"), (
            question
        )
        (call,) = message.tool_calls or []
        if choice == "named":
            assert call.function.name == "get_weather"
        _valid(call)
        assert message.content is None


def test_a_streamed_call_joins_into_valid_arguments(
    client: openai.OpenAI, smollm2: Deployment
) -> None:
    chunks = client.chat.completions.create(
        model=smollm2.model,
        messages=[{"role": "user", "content": QUESTIONS[0]}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=100,
        temperature=0,
        stream=True,
    )
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    name = deltas[0].function.name if deltas[0].function else None
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert deltas[0].id and name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[str(name)])


def test_json_object_is_an_object(client: openai.OpenAI, smollm2: Deployment) -> None:
    answer = client.chat.completions.create(
        model=smollm2.model,
        messages=[{"role": "user", "content": "Give a JSON object about a cat."}],
        response_format={"type": "json_object"},
        max_tokens=100,
        temperature=0,
    )
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)
    else:  # cut by max_tokens: still the start of an object
        assert (answer.choices[0].message.content or "").startswith("{")


def test_a_conversation_with_a_tool_result(client: openai.OpenAI, smollm2: Deployment) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    answer = client.chat.completions.create(
        model=smollm2.model,
        messages=[
            {"role": "user", "content": QUESTIONS[0]},
            {"role": "assistant", "content": None, "tool_calls": [call]},  # type: ignore[list-item]
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": '{"celsius": 21, "sky": "clear"}',
            },
        ],
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
    )
    assert answer.choices[0].message.content
    assert answer.usage and answer.usage.prompt_tokens > 200  # the tool prompt and the history


def test_n_choices_whole_and_streamed(client: openai.OpenAI, smollm2: Deployment) -> None:
    asked: dict[str, Any] = {
        "model": smollm2.model,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 5,
    }
    one = client.chat.completions.create(**asked)
    three = client.chat.completions.create(**asked, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason for c in three.choices)
    assert three.choices[0].message.content == one.choices[0].message.content  # seed + 0
    assert one.usage and three.usage
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    chunks = [c for c in client.chat.completions.create(**asked, n=2, stream=True) if c.choices]
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in chunks:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finished.add(choice.index)
    assert finished == {0, 1}
    assert texts[0] == three.choices[0].message.content
    assert texts[1] == three.choices[1].message.content
