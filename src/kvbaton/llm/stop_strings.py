"""Stop strings matched on generated text, across token boundaries.

Invariant: no text handed out contains a stop string, nor the start of one that later text
completes: a tail of the text that could begin a stop string is held back until the next text
shows that it does not (or `flush()` at the end releases it)."""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """The part of `text` (after what was held back) that is safe to send. Once a stop
        string matches, `matched` names it and everything from it on is dropped."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        # Generation stops where a stop string is first complete: the earliest end wins (then
        # the earliest start), whatever pieces the text came in.
        first = min(
            ((i + len(s), i, s) for s in self.stops if (i := buffer.find(s)) >= 0),
            default=None,
        )
        if first is not None:
            _, start, self.matched = first
            self._held = ""
            return buffer[:start]
        keep = self._partial_tail(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """At the end of generation: release what was held back."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _partial_tail(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:n]):
                    longest = n
                    break
        return longest
