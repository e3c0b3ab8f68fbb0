"""vLLM's /tokenize and /detokenize: the token ids that a prompt or chat messages are given, and
the text of token ids.

- /tokenize gives exactly the ids a completion request with the prompt, or a chat request with
  the messages, tools and template fields, is given (the same functions make them).
- /detokenize keeps special tokens, so that the ids of a templated chat give its text back.
"""

from __future__ import annotations

from typing import Any

from kvbaton.frontend.models import ServedModel
from kvbaton.frontend.openai_types import DetokenizeRequest, TokenizeRequest
from kvbaton.frontend.preprocess import check_token_ids, prompt_token_ids
from kvbaton.frontend.tool_calls import ToolCallFormat
from kvbaton.frontend.tools import tool_use


def tokenize(
    served: ServedModel, body: TokenizeRequest, tool_format: ToolCallFormat
) -> dict[str, Any]:
    """`tool_format`: how the model writes tool calls (a chat history's are written so)."""
    tokenizer = served.tokenizer
    chat = body.chat_request()
    if chat is None:
        assert body.prompt is not None
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        tools = (tool_format, tool_use(chat, tool_format))
        (ids,) = prompt_token_ids(tokenizer, chat, tools)
    strs = tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": served.card.context_length,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize(served: ServedModel, body: DetokenizeRequest) -> dict[str, Any]:
    check_token_ids(body.tokens, served.tokenizer.vocab_size, "tokens", "its items")
    return {"prompt": served.tokenizer.decode(body.tokens, skip_special_tokens=False)}
