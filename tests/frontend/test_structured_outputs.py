"""Constraints through the OpenAI API of a real `kvbaton serve` (a tiny random-weight model:
what it writes is valid by construction, or not at all): `response_format` through the client's
`parse`, vLLM's `guided_*` extension fields, and a 400 naming the field for each bad one."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.frontend.conftest import Deployment

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "Describe a pet."}]


class Pet(pydantic.BaseModel):
    name: Annotated[str, pydantic.StringConstraints(max_length=6)]
    kind: Literal["cat", "dog", "owl"]
    age: Annotated[int, pydantic.Field(ge=0, le=30)]


@pytest.fixture(scope="module")
def client(served: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)


def test_parse_gives_a_valid_object_for_each_prompt(
    client: openai.OpenAI, served: Deployment
) -> None:
    for seed in range(5):
        answer = client.chat.completions.parse(
            model=served.model,
            messages=[{"role": "user", "content": f"Describe pet number {seed}."}],
            response_format=Pet,
            max_tokens=120,
            seed=seed,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)


def test_a_streamed_json_schema_answer_joins_into_a_valid_object(
    client: openai.OpenAI, served: Deployment
) -> None:
    schema = Pet.model_json_schema()
    chunks = client.chat.completions.create(
        model=served.model,
        messages=USER,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}},
        max_tokens=120,
        seed=7,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_a_constrained_answer_cut_by_max_tokens_ends_with_length(
    client: openai.OpenAI, served: Deployment
) -> None:
    text = {"type": "string", "minLength": 40}
    long = {"type": "object", "properties": {"text": text}, "required": ["text"]}
    answer = client.chat.completions.create(
        model=served.model,
        messages=USER,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": long}},
        max_tokens=6,
    )
    assert answer.choices[0].finish_reason == "length"
    assert (answer.choices[0].message.content or "").startswith("{")
    whole = client.chat.completions.create(
        model=served.model,
        messages=USER,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        max_tokens=200,
        seed=1,
    )
    if whole.choices[0].finish_reason == "stop":  # a random model may ramble to the limit
        assert isinstance(json.loads(whole.choices[0].message.content or ""), dict)


def test_guided_regex_and_choice_on_completions(client: openai.OpenAI, served: Deployment) -> None:
    regex = client.completions.create(
        model=served.model,
        prompt="A code:",
        max_tokens=20,
        extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{2}"},
    )
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", regex.choices[0].text)
    choices = ["left", "right", "straight on"]
    for seed in range(3):
        chosen = client.completions.create(
            model=served.model,
            prompt="Which way?",
            max_tokens=20,
            seed=seed,
            extra_body={"guided_choice": choices},
        )
        assert chosen.choices[0].text in choices


NONSENSE = {"type": "nonsense"}
BAD: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": NONSENSE}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_a_bad_constraint_is_a_400_naming_its_field(
    client: openai.OpenAI, served: Deployment, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=served.model,
            messages=USER,  # type: ignore[arg-type]
            max_tokens=8,
            extra_body=fields,
        )
    assert raised.value.status_code == 400
    assert raised.value.body["param"].startswith(param), raised.value.body  # type: ignore[index]
