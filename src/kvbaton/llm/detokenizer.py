"""Generated token ids to text, as they arrive (tokenizers' DecodeStream).

Invariant: the text handed out so far is always valid UTF-8 and a prefix of the decoding of all
tokens seen; bytes of a character split across tokens wait for the token that completes it, and
a character never completed is never emitted."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers.decoders import DecodeStream

from kvbaton.llm.tokenizer import Tokenizer

# Prompt tokens given to the stream as context: enough for decoders that treat the first
# token specially (SentencePiece's leading space), few enough to cost nothing.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int] | None = None,
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._backend = tokenizer.backend
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:]) if prompt_token_ids else None
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def add(self, token_ids: Iterable[int]) -> str:
        """The text that the new tokens complete (possibly empty)."""
        pieces = [self._stream.step(self._backend, t) for t in token_ids]
        return "".join(p for p in pieces if p)
