"""Splits a chat answer's reasoning (`<think>...</think>`) from its content, as the text streams.

The text arrives in pieces (incremental detokenization), so a tag may be split across two
pieces: the splitter holds back only what could still be the start of a tag, never more than
the tag's length less one character, and looks at each piece once.

Formats (`--reasoning-parser`):

- `qwen3`: the model writes both tags; an answer that does not open with `<think>` is all
  content (Qwen3 with thinking off).
- `deepseek-r1`: the chat template ends with `<think>`, so the answer may start inside the
  reasoning without the opening tag (it is dropped if the model writes it anyway); an answer
  without `</think>` is all reasoning.

After `</think>`, everything is content, tags included; nothing else is stripped (the content
keeps the newlines the model wrote after `</think>`).

An answer that continues a message (a chat request's `continue_final_message`) starts where
that message's text left off: inside the reasoning if the text opened it and did not close it,
in the content otherwise (whatever the format: the template's generation prompt, where the
answer would start, is not in the prompt)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class ReasoningFormat:
    """- `start`, `end`: the tags around the reasoning, non-empty.
    - `implicit_start`: the answer starts inside the reasoning whether or not it writes `start`.
    """

    start: str
    end: str
    implicit_start: bool

    def __post_init__(self) -> None:
        if not (self.start and self.end):
            raise ValueError("reasoning tags must be non-empty")


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat("<think>", "</think>", implicit_start=True),
    "qwen3": ReasoningFormat("<think>", "</think>", implicit_start=False),
}


class Split(NamedTuple):
    reasoning: str
    content: str


class _State(enum.Enum):
    OPENING = enum.auto()  # at the start: the opening tag may come
    REASONING = enum.auto()  # inside the reasoning: the closing tag may come
    CONTENT = enum.auto()  # after it (or without reasoning): everything passes


class ReasoningSplitter:
    """One answer's splitter.

    - The reasoning and content of all `feed` results joined are the same however the text was
      cut into pieces (the last piece fed with `final`).
    - Neither tag of the reasoning reaches either part; a tag in the content stays in it.
    - Held back between calls: a prefix of the tag looked for (shorter than the tag), or
      nothing once in the content.
    """

    def __init__(self, fmt: ReasoningFormat, continued: str | None = None) -> None:
        """`continued`: the text of the message the answer continues (see the module's
        docstring); None: the answer starts a message."""
        self.fmt = fmt
        self._state = _State.OPENING if continued is None else _continued_state(fmt, continued)
        self._held = ""

    def feed(self, text: str, final: bool = False) -> Split:
        """The parts of `text` (after what was held back) that are known; `final`: the answer
        ends with `text`, and what would be held back is text, not a tag."""
        reasoning: list[str] = []
        content: list[str] = []
        text = self._held + text
        self._held = ""
        while text:
            if self._state is _State.CONTENT:
                content.append(text)
                break
            if self._state is _State.OPENING:
                tag = self.fmt.start
                if text.startswith(tag):
                    self._state = _State.REASONING
                    text = text[len(tag) :]
                elif tag.startswith(text):
                    self._held = text  # could still become the opening tag
                    break
                else:
                    self._state = _State.REASONING if self.fmt.implicit_start else _State.CONTENT
                continue
            tag = self.fmt.end
            at = text.find(tag)
            if at >= 0:
                reasoning.append(text[:at])
                self._state = _State.CONTENT
                text = text[at + len(tag) :]
                continue
            keep = tag_prefix_at_end(text, tag)
            reasoning.append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            break
        if final and self._held:
            in_reasoning = self._state is _State.REASONING or (
                self._state is _State.OPENING and self.fmt.implicit_start
            )
            (reasoning if in_reasoning else content).append(self._held)
            self._held = ""
        return Split("".join(reasoning), "".join(content))


def reasoning_start(fmt: ReasoningFormat, continued: str | None) -> str | None:
    """How an answer's reasoning starts: "" inside it from the answer's first token, else the
    opening tag the answer must open with; None: it has none (the continued message closed
    it)."""
    if continued is not None:
        return "" if _continued_state(fmt, continued) is _State.REASONING else None
    return "" if fmt.implicit_start else fmt.start


def _continued_state(fmt: ReasoningFormat, continued: str) -> _State:
    """Where an answer continuing `continued` starts: inside the reasoning if the text's last
    opening tag is not closed after it."""
    opened = continued.rfind(fmt.start)
    return _State.REASONING if opened > continued.rfind(fmt.end) else _State.CONTENT


def split_reasoning(fmt: ReasoningFormat, text: str) -> Split:
    """A whole answer's parts."""
    return ReasoningSplitter(fmt).feed(text, final=True)


def tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
