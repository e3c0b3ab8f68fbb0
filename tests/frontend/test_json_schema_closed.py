"""JSON constraints close the objects that list their properties (`llm/json_schema.py`,
`closed`), as vLLM's default backend does: a listed property is taken, an invented one is not,
unless the schema allows others or its properties come from elsewhere (allOf branches)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvbaton.llm.json_schema import closed
from kvbaton.protocols.llm import Guided
from tests.frontend.grammar_helpers import grammar_check

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def takes(chat_model: Path) -> Callable[[dict[str, Any], object], bool]:
    """takes(schema, value): whether the schema's grammar takes the value written compactly."""
    check = grammar_check(chat_model)

    def schema_takes(schema: dict[str, Any], value: object) -> bool:
        text = json.dumps(value, separators=(",", ":"))
        return check(Guided(kind="json", spec=json.dumps(schema)), text)

    return schema_takes


def test_an_object_takes_its_properties_only(takes: Any) -> None:
    assert takes(PERSON, {"name": "Ada", "age": 36})
    assert not takes(PERSON, {"name": "Ada", "age": 36, "memory": [1]})
    listed = {"type": "array", "items": PERSON}
    assert not takes(listed, [{"name": "Ada", "age": 36, "x": 1}])  # nested ones too


def test_a_schema_that_allows_others_keeps_them(takes: Any) -> None:
    assert takes(PERSON | {"additionalProperties": True}, {"name": "Ada", "age": 36, "x": 1})
    typed = PERSON | {"additionalProperties": {"type": "integer"}}
    assert takes(typed, {"name": "Ada", "age": 36, "x": 1})
    assert not takes(typed, {"name": "Ada", "age": 36, "x": "one"})


def test_all_of_branches_still_merge(takes: Any) -> None:
    merged = {
        "allOf": [
            {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"b": {"type": "integer"}}, "required": ["b"]},
        ]
    }
    assert takes(merged, {"a": 1, "b": 2})


def test_alternatives_close_unless_they_extend_properties_of_their_own(takes: Any) -> None:
    either = {
        "anyOf": [
            {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"b": {"type": "integer"}}, "required": ["b"]},
        ]
    }
    assert takes(either, {"b": 2})
    assert not takes(either, {"a": 1, "x": 2})
    extended = {"properties": {"a": {"type": "integer"}}, "required": ["a"]} | either
    assert takes(extended, {"a": 1, "b": 2})


def test_data_in_a_schema_is_left_alone() -> None:
    data = {"properties": {"kind": {"type": "string"}}}
    schema = {"properties": {"x": {"const": data, "default": data}}, "examples": [data]}
    before = json.loads(json.dumps(schema))
    assert closed(schema) == schema | {"additionalProperties": False}
    assert schema == before  # and the schema given is not changed
