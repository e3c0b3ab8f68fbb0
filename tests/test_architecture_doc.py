"""The state diagrams of docs/architecture.md match the code: every state and transition of
each `TRANSITIONS` table is drawn, and nothing else is."""

from __future__ import annotations

import enum
import importlib
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
BLOCK = re.compile(r"```mermaid\n%% (?P<table>[\w.]+)\nstateDiagram-v2\n(?P<body>.*?)```", re.S)
EDGE = re.compile(r"^\s*(\[\*\]|\w+)\s*-->\s*(\[\*\]|\w+)\s*(?::.*)?$")


def diagrams() -> dict[str, str]:
    return {m["table"]: m["body"] for m in BLOCK.finditer(DOC.read_text())}


def drawn(body: str) -> tuple[set[str], set[tuple[str, str]]]:
    """The states and the transitions between states (not from or to [*]) of a diagram."""
    edges = set()
    for line in body.splitlines():
        match = EDGE.match(line)
        assert match or not line.strip(), f"not a transition: {line!r}"
        if match:
            edges.add((match[1], match[2]))
    states = {s for edge in edges for s in edge} - {"[*]"}
    return states, {(a, b) for a, b in edges if "[*]" not in (a, b)}


def coded(path: str) -> tuple[set[str], set[tuple[str, str]]]:
    module, name = path.rsplit(".", 1)
    table: dict[enum.Enum, frozenset[enum.Enum]] = getattr(importlib.import_module(module), name)
    states = {s.name for s in table} | {t.name for targets in table.values() for t in targets}
    return states, {(a.name, b.name) for a, targets in table.items() for b in targets}


def test_each_state_machine_has_a_diagram() -> None:
    assert set(diagrams()) == {
        "kvbaton.disagg.rooms.TRANSITIONS",
        "kvbaton.disagg.push.TRANSITIONS",
    }


@pytest.mark.parametrize("table", sorted(diagrams()))
def test_the_diagram_draws_the_states_and_transitions_of_the_code(table: str) -> None:
    states, edges = drawn(diagrams()[table])
    code_states, code_edges = coded(table)
    assert states == code_states, (
        f"states only drawn: {states - code_states}, only coded: {code_states - states}"
    )
    assert edges == code_edges, (
        f"only drawn: {edges - code_edges}, only coded: {code_edges - edges}"
    )


def test_a_diagram_that_differs_is_caught() -> None:
    body = diagrams()["kvbaton.disagg.rooms.TRANSITIONS"]
    _, edges = drawn(body.replace("    WAITING --> TRANSFERRING: kv_claim accepted\n", ""))
    assert edges != coded("kvbaton.disagg.rooms.TRANSITIONS")[1]
