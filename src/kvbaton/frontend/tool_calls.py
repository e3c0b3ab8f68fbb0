"""Tool calls in a chat answer: the formats of the common model families, parsed as the text
streams, and forced by a grammar for `tool_choice` "required" or a named function.

Formats (`--tool-call-parser`, else the one the chat template writes, else `hermes`):

- `hermes` (Hermes, Qwen 2.5 and 3, and the default tool prompt of `tool_prompt.py`): each call
  is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; text around calls is content.
- `llama3_json` (Llama 3.1-3.3): the answer opens with a call, `{"name": ..., "parameters":
  {...}}` (after `<|python_tag|>` or not); more calls follow after `;`.
- `mistral`: `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`.

`ToolCallParser` invariants:
- Content never carries a call's markup; text that could still become a marker is held back
  (less than the marker's length), and given back as content if it does not.
- Each call is announced once (index, id, name), then its arguments in fragments whose join is
  the JSON text of the arguments the model wrote.
- The calls and the content are the same however the text is cut into pieces.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbaton.frontend.reasoning import tag_prefix_at_end

WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class ToolCallFormat:
    """- `start`: the marker before the calls ("" if none); `opens_with`: characters that, as
      an answer's first text, open calls without it.
    - `separators`: characters skipped between calls; `end`: the marker after them (None: none).
    - `args_key`: the key of a call's arguments (`arguments` is read too).
    - `call`: how one call is written (`{call}`: its JSON object); `between`: between two
      calls; `before`, `after`: before the first and after the last.
    - `result`: how a tool's result is written in a prompt whose template takes no tools.
    """

    name: str
    start: str
    opens_with: str
    separators: str
    end: str | None
    args_key: str
    call: str
    between: str
    before: str = ""
    after: str = ""
    result: str = "{result}"

    def write(self, calls: Sequence[tuple[str, Any]]) -> str:
        """The calls (name, arguments) as the model writes them."""
        objects = [
            self.call.replace("{call}", json.dumps({"name": n, self.args_key: a})) for n, a in calls
        ]
        return self.before + self.between.join(objects) + self.after

    def forced_grammar(self, call_schema: dict[str, Any], parallel: bool) -> str:
        """llguidance's Lark grammar for an answer of one call (or more, if `parallel`)."""
        head, tail = self.call.split("{call}")
        more = f"({_lark_literal(self.between)} call)*" if parallel else ""
        start = _lark_join(_lark_literal(self.before), "call", more, _lark_literal(self.after))
        schema = {"x-guidance": {"whitespace_flexible": False}, **call_schema}
        return (
            f"start: {start}\n"
            f"call: {_lark_join(_lark_literal(head), 'object', _lark_literal(tail))}\n"
            f"object: %json {json.dumps(schema)}\n"
        )


def _lark_literal(text: str) -> str:
    return json.dumps(text) if text else ""


def _lark_join(*parts: str) -> str:
    return " ".join(part for part in parts if part)


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat(
        name="hermes",
        start="<tool_call>",
        opens_with="",
        separators=WHITESPACE,
        end="</tool_call>",
        args_key="arguments",
        call="<tool_call>\n{call}\n</tool_call>",
        between="\n",
        result="<tool_response>\n{result}\n</tool_response>",
    ),
    "llama3_json": ToolCallFormat(
        name="llama3_json",
        start="<|python_tag|>",
        opens_with="{",
        separators=WHITESPACE + ";",
        end=None,
        args_key="parameters",
        call="{call}",
        between="; ",
    ),
    "mistral": ToolCallFormat(  # `[TOOL_CALLS]` is a special token: the answer may lack it
        name="mistral",
        start="[TOOL_CALLS]",
        opens_with="[",
        separators=WHITESPACE + "[,",
        end="]",
        args_key="arguments",
        call="{call}",
        between=", ",
        before="[TOOL_CALLS][",
        after="]",
    ),
}


def format_of_template(template: str) -> ToolCallFormat:
    """The format a chat template writes calls in; hermes if it writes none that is known."""
    if "[TOOL_CALLS]" in template:
        return TOOL_CALL_FORMATS["mistral"]
    if "<|python_tag|>" in template or '"parameters"' in template:
        return TOOL_CALL_FORMATS["llama3_json"]
    return TOOL_CALL_FORMATS["hermes"]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text


@dataclass
class ToolCallDelta:
    """A call's announcement (`id` and `name` set) or a fragment of its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ToolCallSplit:
    content: str
    calls: list[ToolCallDelta] = field(default_factory=list)


class _State(enum.Enum):
    CONTENT = enum.auto()  # text is content; the start marker may come
    BETWEEN = enum.auto()  # among calls: separators, the end marker, or a call's `{`
    CALL = enum.auto()  # inside a call's JSON object


_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:')


class ToolCallParser:
    """One answer's parser (see the module's invariants). `max_calls`: calls past it are
    dropped (`parallel_tool_calls` false: 1)."""

    def __init__(self, fmt: ToolCallFormat, max_calls: int | None = None) -> None:
        self.fmt = fmt
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self._state = _State.CONTENT
        self._at_start = True  # nothing but whitespace yet
        self._quiet = True  # at the start or after a call: whitespace may be no content
        self._held = ""  # text not yet known to be content or markup
        self._object = _JsonObject()
        self._announced = False
        self._args_from: int | None = None  # where the streamed arguments start in the object
        self._args_sent = 0

    def feed(self, text: str, final: bool = False) -> ToolCallSplit:
        out = ToolCallSplit("")
        content: list[str] = []
        text = self._held + text
        self._held = ""
        i = 0
        while i < len(text):
            if self._state is _State.CALL:
                i = self._in_call(text, i, out)
            elif self._state is _State.CONTENT:
                i = self._in_content(text, i, content)
            else:
                i = self._between(text, i)
        if self._state is _State.CALL:
            self._send_arguments(out)
        if final:
            self._finish(content)
        out.content = "".join(content)
        return out

    # -- the states --------------------------------------------------------------------------
    def _in_content(self, text: str, i: int, content: list[str]) -> int:
        start = self.fmt.start
        if self._quiet:  # at the start, or after a call: whitespace waits to be known
            rest = text[i:].lstrip(WHITESPACE)
            if not rest or (start and start.startswith(rest)):
                self._held = text[i:]
                return len(text)
            marked = bool(start) and rest.startswith(start)
            opens = marked or (self._at_start and rest[0] in self.fmt.opens_with)
            self._quiet = self._at_start = False
            if opens:
                self._state = _State.BETWEEN
                return len(text) - len(rest) + (len(start) if marked else 0)
        at = text.find(start, i) if start else -1
        if at >= 0:
            content.append(text[i:at])
            self._state = _State.BETWEEN
            return at + len(start)
        keep = tag_prefix_at_end(text[i:], start) if start else 0
        content.append(text[i : len(text) - keep])
        self._held = text[len(text) - keep :]
        return len(text)

    def _between(self, text: str, i: int) -> int:
        ch = text[i]
        if ch in self.fmt.separators:
            return i + 1
        if ch == "{":
            self._state = _State.CALL
            self._object = _JsonObject()
            self._announced = False
            self._args_from = None
            self._args_sent = 0
            return i
        end = self.fmt.end
        if end is not None:
            if text.startswith(end, i):
                self._state = _State.CONTENT
                return i + len(end)
            if end.startswith(text[i:]):
                self._held = text[i:]  # may become the end marker
                return len(text)
        if self.fmt.start and text.startswith(self.fmt.start, i):
            return i + len(self.fmt.start)
        if self.fmt.start and self.fmt.start.startswith(text[i:]):
            self._held = text[i:]
            return len(text)
        self._state = _State.CONTENT
        return i

    def _in_call(self, text: str, i: int, out: ToolCallSplit) -> int:
        obj = self._object
        while i < len(text):
            ch = text[i]
            obj.add(ch)
            i += 1
            if not self._announced and ch == ":" and obj.depth == 1 and not obj.in_string:
                self._announce(out)
            if obj.closed:
                self._send_arguments(out)
                self._close_call(out)
                self._state = _State.BETWEEN
                self._quiet = True
                break
        return i

    # -- calls ---------------------------------------------------------------------------------
    def _announce(self, out: ToolCallSplit) -> None:
        match = _HEADER.match(self._object.text)
        if match is None:
            return
        self._announced = True
        self._args_from = match.end()
        self._new_call(json.loads(match.group(1)), out)

    def _new_call(self, name: str, out: ToolCallSplit) -> None:
        call = ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name)
        self.calls.append(call)
        if self._keeps(len(self.calls) - 1):
            out.calls.append(ToolCallDelta(len(self.calls) - 1, "", call.id, call.name))

    def _keeps(self, index: int) -> bool:
        return self.max_calls is None or index < self.max_calls

    def _send_arguments(self, out: ToolCallSplit) -> None:
        """Stream what is new of an object-valued arguments (a string-valued one waits for the
        call's end)."""
        if self._args_from is None:
            return
        text = self._object.text
        value = text[self._args_from :].lstrip(WHITESPACE)
        if not value or value[0] not in "{[":
            return
        start = len(text) - len(value)
        end = self._object.value_end(start)
        piece = text[start + self._args_sent : end]
        if piece:
            self._args_sent += len(piece)
            self._add_arguments(piece, out)

    def _add_arguments(self, piece: str, out: ToolCallSplit) -> None:
        index = len(self.calls) - 1
        self.calls[index].arguments += piece
        if self._keeps(index):
            out.calls.append(ToolCallDelta(index, piece))

    def _close_call(self, out: ToolCallSplit) -> None:
        if self._announced and self._args_sent:
            return
        try:
            parsed = json.loads(self._object.text)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            return  # not a call: dropped, as markup
        args = parsed.get(self.fmt.args_key, parsed.get("arguments", {}))
        if not self._announced:
            self._announced = True
            self._new_call(parsed["name"], out)
        self._add_arguments(args if isinstance(args, str) else json.dumps(args), out)

    def _finish(self, content: list[str]) -> None:
        if self._state is _State.CALL and not self._announced:
            content.append(self._object.text)  # an unfinished object that never named a call
        if self._held.strip(WHITESPACE) or not self.calls:
            content.append(self._held)  # whitespace after calls is no content
        self._held = ""

    @property
    def kept_calls(self) -> list[ToolCall]:
        return self.calls if self.max_calls is None else self.calls[: self.max_calls]


class _JsonObject:
    """A JSON object's text as it arrives, with its nesting depth (strings and escapes known)."""

    def __init__(self) -> None:
        self._chars: list[str] = []
        self._ends: dict[int, int] = {}  # a value's first index -> the index after it
        self._opened: list[int] = []
        self.depth = 0
        self.in_string = False
        self._escaped = False
        self.closed = False

    @property
    def text(self) -> str:
        return "".join(self._chars)

    def add(self, ch: str) -> None:
        index = len(self._chars)
        self._chars.append(ch)
        if self.in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
            self._opened.append(index)
        elif ch in "}]":
            self.depth -= 1
            if self._opened:
                self._ends[self._opened.pop()] = index + 1
            self.closed = self.depth == 0

    def value_end(self, start: int) -> int:
        """Where the object or array opened at `start` ends (its text so far, if open)."""
        return self._ends.get(start, len(self._chars))
