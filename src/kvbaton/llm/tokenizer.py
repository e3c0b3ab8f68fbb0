"""The model's tokenizer (HF tokenizers through transformers), with its chat template.

- Importing transformers' `AutoTokenizer` takes seconds (it imports torch); reading a
  tokenizer's files after that, a fraction of one. `preload` does the import ahead, on a thread,
  so that a `Tokenizer` made later (a frontend's first model) only reads files.
- One thread imports transformers at a time (`_IMPORTING`): its modules import each other, and
  two threads importing them at once can deadlock on Python's module locks.
"""

from __future__ import annotations

import functools
import inspect
import threading
from pathlib import Path
from typing import Any

_IMPORTING = threading.Lock()


class ReservedNameError(ValueError):
    """A template variable named as one the template's caller sets itself."""


def preload() -> threading.Thread:
    """Import what a `Tokenizer` needs, on a thread of its own (started, returned)."""
    thread = threading.Thread(target=_import_auto_tokenizer, name="tokenizer-preload", daemon=True)
    thread.start()
    return thread


def _import_auto_tokenizer() -> Any:
    with _IMPORTING:
        from transformers import AutoTokenizer

        return AutoTokenizer


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        self.hf: Any = _import_auto_tokenizer().from_pretrained(str(model_dir))
        self.backend: Any = self.hf.backend_tokenizer  # the Rust tokenizer: encodes 2x faster
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.vocab_size: int = len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast lets go of the GIL while it works (encode does not, wholly), and
        # skips the offsets (unused here): a long prompt encoded on a thread leaves the event
        # loop free.
        (encoding,) = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        encodings = self.backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encodings]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """- `tools`: passed to a template that takes them (`takes_tools`).
        - `continue_final_message`: the prompt ends inside the last message (its end-of-turn
          left out), for the model to go on writing it.
        - `template_kwargs`: more variables for the template; one named as one of
          `reserved_template_names` is a ReservedNameError."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        extra = template_kwargs or {}
        if clash := sorted(set(extra) & self.reserved_template_names):
            raise ReservedNameError(f"cannot set {', '.join(clash)} (the server sets it)")
        text = self.hf.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **extra,
        )
        return self.encode(str(text), add_special_tokens=False)

    @functools.cached_property
    def reserved_template_names(self) -> frozenset[str]:
        """Names the template's caller sets itself: the parameters of transformers'
        `apply_chat_template`, and `messages`."""
        names = inspect.signature(self.hf.apply_chat_template).parameters
        return frozenset(names) - {"kwargs"} | {"messages"}

    @functools.cached_property
    def chat_template(self) -> str:
        """The chat template's source ("" if none; a template set: all of them)."""
        template = getattr(self.hf, "chat_template", None) or ""
        return "\n".join(template.values()) if isinstance(template, dict) else str(template)

    @property
    def takes_tools(self) -> bool:
        """Whether the chat template renders `tools`."""
        return "tools" in self.chat_template
