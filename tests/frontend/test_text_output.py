"""Incremental detokenization and stop strings, on the byte-level tokenizer of the tiny model."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvbaton.llm.detokenizer import IncrementalDetokenizer
from kvbaton.llm.stop_strings import StopStringMatcher
from kvbaton.llm.tokenizer import Tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(chat_model: Path) -> Tokenizer:
    return Tokenizer(chat_model)


def test_characters_split_across_tokens_come_out_whole(tokenizer: Tokenizer) -> None:
    text = "Grüße aus Köln: 日本語 🙂🚀 done"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.encode()) // 4  # many multi-byte characters span tokens
    detok = IncrementalDetokenizer(tokenizer, [1, 2])
    pieces = [detok.add([t]) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # some tokens held back a partial character


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """What the client must see: the text up to the stop string that is complete first (the
    earliest end; on a tie, the earliest start), if any."""
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return (text[: min(hits)[1]], True) if hits else (text, False)


@example(text=" aa", stops=["a", " aa"], cuts=[2])  # "a" is complete before " aa"
@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc日 ", max_size=30),
    stops=st.lists(st.text(alphabet="abc日 ", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=10),
)
def test_stop_strings_never_leak_however_the_text_is_cut(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    matcher = StopStringMatcher(stops)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    sent = [matcher.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    for i in range(len(sent)):  # no prefix of what was sent holds a stop string
        assert reference("".join(sent[: i + 1]), stops)[1] is False
    sent.append(matcher.flush())
    expected, stopped = reference(text, stops)
    assert "".join(sent) == expected
    assert (matcher.matched is not None) == stopped


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(max_size=60) | st.sampled_from(["<|im_start|>user\nhi<|im_end|>\n", " \n\n a"]),
    special=st.booleans(),
)
def test_encoding_equals_transformers(tokenizer: Tokenizer, text: str, special: bool) -> None:
    assert tokenizer.encode(text, special) == tokenizer.hf.encode(text, add_special_tokens=special)
    assert tokenizer.encode_batch([text, text[::-1]], special) == [
        tokenizer.hf.encode(t, add_special_tokens=special) for t in (text, text[::-1])
    ]
