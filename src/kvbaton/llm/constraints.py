"""Output constraints as llguidance grammars (no torch here: the frontend validates with it,
the engine enforces with `engine/guided.py`).

- One grammar per (kind, spec), cached.
- An invalid constraint is a ValueError naming its kind.
- A JSON schema's objects that list their properties are closed to others (`json_schema.py`).
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

import llguidance

from kvbaton.llm.json_schema import closed
from kvbaton.protocols.llm import Guided

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

CACHED = 256
COMPACT_JSON: JsonCompileOptions = {"whitespace_flexible": False}  # no free whitespace


def grammar(guided: Guided) -> str:
    """llguidance's grammar for a constraint; ValueError naming what is wrong."""
    return _grammar(guided.kind, guided.spec)


@functools.lru_cache(maxsize=CACHED)
def _grammar(kind: str, spec: str) -> str:
    try:
        if kind == "json":
            schema = closed(json.loads(spec))
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT_JSON)
        elif kind == "regex":
            text = llguidance.LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            choices = json.loads(spec)
            if not isinstance(choices, list) or not choices:
                raise ValueError("a choice is a non-empty list of strings")
            text = llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(str(choice)) for choice in choices)
            )
        elif kind == "grammar":
            text = llguidance.LLMatcher.grammar_from_lark(spec)
        else:
            raise ValueError(f"kind must be one of {', '.join(Guided.KINDS)}")
        error = llguidance.LLMatcher.validate_grammar(text)
    except (ValueError, TypeError) as exc:
        error = str(exc)
    if error:
        raise ValueError(f"the {kind} constraint is invalid: {error}")
    return text
