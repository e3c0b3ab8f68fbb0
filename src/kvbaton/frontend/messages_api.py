"""The request of Anthropic's Messages API (`POST /v1/messages`, and `/v1/messages/count_tokens`):
it becomes a chat request of the same conversation, whose answer becomes the message
(`messages_output.py`). For clients written against Anthropic's API (its SDKs, coding agents)
to run on kvbaton's models.

- Messages: user and assistant turns of a string or content blocks: `text`, `tool_use` (an
  assistant's calls), `tool_result` (a user turn's answers to them, each a tool message before
  the turn's text; `is_error` marks the text "Error: "). Earlier `thinking` and
  `redacted_thinking` blocks are taken and left out of the prompt, as chat templates leave out
  earlier turns' reasoning. Images, documents and other blocks are a 400 naming the block.
- A last assistant turn is the start of the answer (Anthropic's prefill): the answer goes on
  from its text (chat's `continue_final_message`).
- `system`, custom `tools` (`input_schema` the function's parameters), `tool_choice` (auto,
  any: some call, tool: that one, none; `disable_parallel_tool_use`), `stop_sequences`,
  `temperature`, `top_p`, `top_k`, `max_tokens` (past the model's context: cut to the room the
  prompt leaves, the answer then stopping with "model_context_window_exceeded"); `thinking`
  enabled or adaptive (the template's `enable_thinking` true; `display` "omitted" leaves the
  thinking's text out of the answer; `budget_tokens` is chat's `thinking_token_budget`, not
  required: where that could not be enforced, only `max_tokens` bounds the thinking) or
  disabled (false); `output_config.effort` (the template's `reasoning_effort`) and
  `output_config.format` (a JSON schema, enforced). A tool's `strict` is chat's: its schema is
  enforced when the call is forced, either way.
- Fields that name the caller or steer Anthropic's caching and routing are taken and change
  nothing (`_HARMLESS`; `cache_control` on blocks and tools); any other is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, ValidationError, field_validator, model_validator

from kvbaton.frontend.openai_types import (
    ChatCompletionRequest,
    FieldError,
    FunctionName,
    PositiveInt,
    _Body,
    _NullIsDefault,
    joined_text,
    validated_by_type,
    without,
)

_HARMLESS = (
    "metadata",
    "service_tier",
    "cache_control",
    "inference_geo",
    "user_profile_id",
    "workspace_id",
)


class _Block(_NullIsDefault):
    cache_control: Any = None  # a hint to Anthropic's prompt cache: kvbaton caches prefixes


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[Any] | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    caller: Any = None  # the SDK's blocks carry these, as they came
    toolset_name: str | None = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False
    toolset_name: str | None = None

    def text(self) -> str:
        text = joined_text(self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Block):
    """An earlier answer's reasoning: taken, left out of the prompt."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
_BLOCKS: dict[str, type[Block]] = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": RedactedThinkingBlock,
}


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks_by_type(cls, value: Any) -> Any:
        return (
            validated_by_type(value, _BLOCKS, "content block") if isinstance(value, list) else value
        )

    def texts(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))

    def blocks(self, kind: type[Block]) -> list[Any]:
        return (
            [b for b in self.content if isinstance(b, kind)]
            if isinstance(self.content, list)
            else []
        )


# The blocks each role's turns cannot hold (Anthropic's API refuses them too).
_NOT_IN: dict[str, tuple[type[Block], ...]] = {
    "user": (ToolUseBlock, ThinkingBlock, RedactedThinkingBlock),
    "assistant": (ToolResultBlock,),
}


class Tool(_Body):
    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: Any = None
    strict: bool | None = None


class ToolChoice(_NullIsDefault):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_NullIsDefault):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_NullIsDefault):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class _CutChatRequest(ChatCompletionRequest):
    """A chat request whose `max_tokens` past the context is cut to the room left: Anthropic's
    clients ask for more than most models hold (stop reason model_context_window_exceeded)."""

    cut_to_context = True
    budget_required = False


class _Conversation(_NullIsDefault):
    """What both routes take: the conversation and what shapes its prompt."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _custom_tools_only(cls, value: Any) -> Any:
        for tool in value if isinstance(value, list) else []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise ValueError(f"a tool of type {kind!r} is not supported: custom tools are")
        return value

    @model_validator(mode="before")
    @classmethod
    def _drop_harmless(cls, data: Any) -> Any:
        return without(data, _HARMLESS)

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request that answers this one (FieldError naming this request's field)."""
        messages = self._chat_messages()
        body: dict[str, Any] = {"model": self.model, "messages": messages, **self._sampling()}
        if messages[-1]["role"] == "assistant":  # Anthropic's prefill: the answer goes on
            body["continue_final_message"] = True
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "parameters": t.input_schema,
                        **({"description": t.description} if t.description else {}),
                        **({"strict": t.strict} if t.strict is not None else {}),
                    },
                }
                for t in self.tools
            ]
        self._add_tool_choice(body)
        self._add_reasoning(body)
        out = self.output_config
        if out is not None and out.format is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": out.format.schema_},
            }
        try:
            return _CutChatRequest.model_validate(body)
        except ValidationError as e:  # the fields above are checked: what is left is messages'
            raise FieldError("messages", e.errors()[0]["msg"]) from None

    def _sampling(self) -> dict[str, Any]:
        return {}

    def _add_tool_choice(self, body: dict[str, Any]) -> None:
        choice = self.tool_choice
        if choice is None:
            return
        if choice.type == "tool":
            if not choice.name:
                raise FieldError("tool_choice", "tool_choice of type tool needs a name")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice.name is not None:
            raise FieldError("tool_choice", f"tool_choice of type {choice.type} takes no name")
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False

    def _add_reasoning(self, body: dict[str, Any]) -> None:
        if self.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
            if self.thinking.type == "enabled" and self.thinking.budget_tokens is not None:
                body["thinking_token_budget"] = self.thinking.budget_tokens
        if self.output_config is not None and self.output_config.effort is not None:
            body["reasoning_effort"] = self.output_config.effort

    def _chat_messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": joined_text(self.system)})
        for i, message in enumerate(self.messages):
            misplaced = _NOT_IN[message.role]
            for block in message.content if isinstance(message.content, list) else []:
                if isinstance(block, misplaced):
                    raise FieldError(
                        "messages",
                        f"message {i}: a {block.type} block cannot be in a {message.role} turn",
                    )
            if message.role == "user":
                for result in message.blocks(ToolResultBlock):
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": result.tool_use_id,
                            "content": result.text(),
                        }
                    )
                text = message.texts()
                if text or not message.blocks(ToolResultBlock):
                    messages.append({"role": "user", "content": text})
                continue
            calls = [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": use.name, "arguments": json.dumps(use.input)},
                }
                for use in message.blocks(ToolUseBlock)
            ]
            assistant: dict[str, Any] = {"role": "assistant", "content": message.texts() or None}
            if calls:
                assistant["tool_calls"] = calls
            elif assistant["content"] is None:
                assistant["content"] = ""  # thinking alone: an empty turn
            messages.append(assistant)
        return messages


class MessagesRequest(_Conversation):
    max_tokens: PositiveInt
    stop_sequences: Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None

    def _sampling(self) -> dict[str, Any]:
        given = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences or None,
            "stream": self.stream,
            "stream_options": {"include_usage": True} if self.stream else None,
        }
        return {name: value for name, value in given.items() if value is not None}


class CountTokensRequest(_Conversation):
    """`/v1/messages/count_tokens`: the tokens of the prompt a message request would be given."""
