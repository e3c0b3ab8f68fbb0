"""Whether a constraint's grammar takes a text, without an engine: the engine's own matchers
(`GuidedDecoding`) over the model's tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvbaton.engine.guided import GuidedDecoding
from kvbaton.llm.constraints import grammar
from kvbaton.llm.tokenizer import Tokenizer
from kvbaton.protocols.llm import Guided


def grammar_check(model_dir: Path) -> Callable[[Guided, str], bool]:
    """takes(guided, text): whether `guided`'s grammar takes `text` whole. An invalid constraint
    raises ValueError (it is never just "not taken")."""
    tokenizer = Tokenizer(model_dir)
    eos = frozenset() if tokenizer.eos_token_id is None else frozenset({tokenizer.eos_token_id})
    guided_decoding = GuidedDecoding(model_dir, tokenizer.vocab_size, eos)

    def takes(guided: Guided, text: str) -> bool:
        grammar(guided)  # ValueError if the constraint is invalid
        try:
            matcher = guided_decoding.matcher(
                guided, tokenizer.encode(text, add_special_tokens=False)
            )
        except ValueError:  # the text breaks the constraint
            return False
        return bool(matcher.is_accepting())

    return takes
