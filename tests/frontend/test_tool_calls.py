"""The tool-call parser of each format: the same calls and content however the text is cut,
argument fragments that join into each call's JSON, no markup in the content."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from kvbaton.frontend.tool_calls import (
    TOOL_CALL_FORMATS,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    format_of_template,
)

ANSWERS = {
    "hermes": (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"u": {"a": [1, "}"]}}}\n</tool_call>\n<tool_call>\n{"arguments": {"x": 1}, '
        '"name": "f"}\n</tool_call>\n'
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "g", "parameters": {}}'
    ),
    "mistral": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "g", "arguments": "{\\"a\\": 1}"}]'
    ),
}
CALLS = {
    "hermes": [
        ("get_weather", '{"city": "Paris", "u": {"a": [1, "}"]}}'),
        ("f", '{"x": 1}'),
    ],
    "llama3_json": [("get_weather", '{"city": "Paris"}'), ("g", "{}")],
    "mistral": [("get_weather", '{"city": "Paris"}'), ("g", '{"a": 1}')],
}
CONTENT = {"hermes": "Sure.\n", "llama3_json": "", "mistral": ""}


def parse(
    fmt: str, text: str, cuts: list[int], max_calls: int | None = None
) -> tuple[str, list[ToolCallDelta], list[ToolCall]]:
    parser = ToolCallParser(TOOL_CALL_FORMATS[fmt], max_calls)
    bounds = [0, *sorted(cuts), len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    content, deltas = [], []
    for k, piece in enumerate(pieces):
        out = parser.feed(piece, final=k == len(pieces) - 1)
        content.append(out.content)
        deltas += out.calls
    return "".join(content), deltas, parser.kept_calls


@pytest.mark.parametrize("fmt", sorted(ANSWERS))
def test_same_calls_however_the_text_is_cut(fmt: str) -> None:
    text = ANSWERS[fmt]
    for seed in range(200):
        rng = random.Random(seed)
        cuts = rng.sample(range(1, len(text)), rng.randint(0, 40))
        content, deltas, calls = parse(fmt, text, cuts)
        assert content == CONTENT[fmt]
        assert [(c.name, c.arguments) for c in calls] == CALLS[fmt]
        announced = [d for d in deltas if d.name is not None]
        assert [(d.index, d.name, d.id) for d in announced] == [
            (i, c.name, c.id) for i, c in enumerate(calls)
        ]
        joined: dict[int, str] = {}
        for d in deltas:
            assert d.index in {a.index for a in announced[: d.index + 1]}  # announced first
            joined[d.index] = joined.get(d.index, "") + d.arguments
        assert [joined[i] for i in sorted(joined)] == [c.arguments for c in calls]
        for call in calls:
            json.loads(call.arguments)


def test_arguments_stream_before_the_call_ends() -> None:
    parser = ToolCallParser(TOOL_CALL_FORMATS["hermes"])
    head = parser.feed('<tool_call>\n{"name": "f", "arguments": {"city": "Pa')
    assert [(d.name, d.arguments) for d in head.calls] == [("f", ""), (None, '{"city": "Pa')]
    tail = parser.feed('ris"}}\n</tool_call>', final=True)
    assert [d.arguments for d in tail.calls] == ['ris"}'] and tail.content == ""


def test_text_that_only_looks_like_a_marker_is_content() -> None:
    assert parse("hermes", "a < b and <tool but no call", [3, 11, 13])[0] == (
        "a < b and <tool but no call"
    )
    assert parse("hermes", "ends with <tool_c", [12])[0] == "ends with <tool_c"
    assert parse("llama3_json", "Not { a call", [])[0] == "Not { a call"
    assert parse("hermes", "  \n", [1])[0] == "  \n"


def test_parallel_calls_off_keeps_the_first() -> None:
    _content, deltas, calls = parse("hermes", ANSWERS["hermes"], [20, 50], max_calls=1)
    assert [c.name for c in calls] == ["get_weather"]
    assert {d.index for d in deltas} == {0}


def test_an_unfinished_call_keeps_what_came() -> None:
    content, _, calls = parse("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1', [])
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1')]
    content, _, calls = parse("hermes", '<tool_call>\n{"argu', [])
    assert calls == [] and content == '{"argu'


@pytest.mark.parametrize("fmt", sorted(TOOL_CALL_FORMATS))
def test_written_calls_parse_back(fmt: str) -> None:
    written = TOOL_CALL_FORMATS[fmt].write([("f", {"a": 1}), ("g", {})])
    content, _, calls = parse(fmt, written, [])
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"a": 1}),
        ("g", {}),
    ]


def test_format_of_template() -> None:
    assert format_of_template("{{ '<tool_call>' }}").name == "hermes"
    assert format_of_template("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert format_of_template("{{ '<|python_tag|>' }}").name == "llama3_json"
    assert format_of_template("no tools").name == "hermes"
