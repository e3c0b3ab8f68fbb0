"""Whether a constraint's grammar takes a text, without an engine (llguidance's matcher over the
model's tokenizer)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import llguidance

from kvbaton.llm.constraints import grammar
from kvbaton.llm.tokenizer import Tokenizer
from kvbaton.protocols.llm import Guided


def grammar_check(model_dir: Path) -> Callable[[Guided, str], bool]:
    """takes(guided, text): whether `guided`'s grammar takes `text` whole (the tokenizer is read
    once)."""
    tokenizer = Tokenizer(model_dir)
    lltok = llguidance.LLTokenizer(
        (model_dir / "tokenizer.json").read_text(),
        n_vocab=tokenizer.vocab_size,
        eos_token=tokenizer.eos_token_id,
    )

    def takes(guided: Guided, text: str) -> bool:
        matcher = llguidance.LLMatcher(lltok, grammar(guided))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    return takes
