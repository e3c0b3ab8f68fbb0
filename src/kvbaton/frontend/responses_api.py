"""The request of OpenAI's Responses API (`POST /v1/responses`), without state: it becomes a chat
request (its input items the messages, its function tools and text format the chat's), whose
answer becomes the response (`responses_output.py`).

- `store` (true unless false) keeps the response (`response_store.py`); `previous_response_id`
  prepends the conversation of a kept one: its input items, then its output items (not its
  `instructions`, as OpenAI's API does). `conversation` and `background` are a 400 naming them.
- `include`: "message.output_text.logprobs" (the message's token logprobs, `top_logprobs`
  alternatives each) and "reasoning.encrypted_content" (a reasoning item's text, base64: not
  encrypted, kvbaton holds no key; what clients that carry reasoning across stateless turns
  send back). Any other is a 400 naming `include`.
- Input: a string (one user message) or items: messages (user, system, developer and
  assistant; text parts), `function_call` items (an assistant's calls) and
  `function_call_output` items (tool messages). Earlier `reasoning` items are taken and left
  out of the prompt, as chat templates leave out earlier turns' reasoning.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from kvbaton.frontend.openai_types import (
    HARMLESS_FIELDS,
    ChatCompletionRequest,
    FieldError,
    FunctionName,
    PositiveInt,
    ReasoningEffort,
    Verbosity,
    _Body,
    _NullIsDefault,
    joined_text,
    validated_by_type,
    without,
)
from kvbaton.protocols.stored_responses import StoredResponse

_HARMLESS = tuple(f for f in HARMLESS_FIELDS if f not in ("store", "metadata"))  # kept here
LOGPROBS = "message.output_text.logprobs"
ENCRYPTED_REASONING = "reasoning.encrypted_content"


class TextPart(_Body):
    """A message's text: `input_text`, or an earlier answer's `output_text`."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier answer's (none are written here)
    logprobs: list[Any] | None = None


class MessageItem(_NullIsDefault):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return joined_text(self.content)


class FunctionCallItem(_NullIsDefault):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_NullIsDefault):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return joined_text(self.output)


class ReasoningItem(_NullIsDefault):
    """An earlier answer's reasoning: taken, left out of the prompt."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEMS: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


_ID_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def input_items(value: list[Any]) -> list[InputItem]:
    return validated_by_type(value, _ITEMS, "input item", default="message")


class FunctionTool(_Body):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (none: no arguments)
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextConfig(_NullIsDefault):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    verbosity: Verbosity | None = None


class StreamOptions(_NullIsDefault):
    """Taken, changing nothing: OpenAI pads its delta events against size side channels."""

    include_obfuscation: bool = True


class ReasoningConfig(_NullIsDefault):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_NullIsDefault):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    store: bool = True
    metadata: dict[str, str] | None = None  # given back with the response
    previous_response_id: str | None = None
    stream_options: StreamOptions | None = None
    # Recognised, not supported: refused when given a value that would need them.
    conversation: Any = None
    background: bool | None = None
    max_tool_calls: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_harmless(cls, data: Any) -> Any:
        return without(data, _HARMLESS)

    @field_validator("input", mode="before")
    @classmethod
    def _items_by_type(cls, value: Any) -> Any:
        return input_items(value) if isinstance(value, list) else value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        for tool in value if isinstance(value, list) else []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"a tool of type {kind!r} is not supported: function tools are")
        return value

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        stateful = {
            "conversation": self.conversation is not None,
            "background": bool(self.background),
        }
        unsupported = {
            "max_tool_calls": self.max_tool_calls is not None,
            "text.verbosity": self.text is not None and self.text.verbosity not in (None, "medium"),
            "truncation": self.truncation == "auto",
            "reasoning.summary": self.reasoning is not None
            and (self.reasoning.summary or self.reasoning.generate_summary) is not None,
        }
        for name, given in stateful.items():
            if given:
                raise FieldError(name, f"{name}: not supported by this server yet")
        for name, given in unsupported.items():
            if given:
                raise FieldError(name, f"{name}: not supported by this server yet")
        for value in self.include or []:
            if value not in (LOGPROBS, ENCRYPTED_REASONING):
                raise FieldError(
                    "include",
                    f"include: {value!r} is not supported ({LOGPROBS!r} and "
                    f"{ENCRYPTED_REASONING!r} are)",
                )
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", f"top_logprobs needs include [{LOGPROBS!r}]")
        if not self.input:
            raise FieldError("input", "input is empty")
        return self

    @property
    def logprobs(self) -> bool:
        """Whether the message's token logprobs are asked for."""
        return LOGPROBS in (self.include or [])

    @property
    def encrypted_reasoning(self) -> bool:
        """Whether reasoning items carry `encrypted_content`."""
        return ENCRYPTED_REASONING in (self.include or [])

    def after(self, previous: StoredResponse) -> ResponsesRequest:
        """This request with the conversation of `previous` (kept) before its input."""
        earlier = [*previous.input, *previous.response["output"]]
        return self.model_copy(update={"input": input_items(earlier) + self.items()})

    def items(self) -> list[InputItem]:
        """The input as items (a string: one user message)."""
        if isinstance(self.input, str):
            return [
                MessageItem(role="user", content=[TextPart(type="input_text", text=self.input)])
            ]
        return list(self.input)

    def kept_input(self) -> list[dict[str, Any]]:
        """The input items as kept with the response, in the API's item shape: each with an id
        (given one if it had none) and a status; a message's text as a list of parts."""
        kept = []
        for item in self.items():
            body = item.model_dump(exclude_none=True)
            if isinstance(item, MessageItem) and isinstance(item.content, str):
                kind = "output_text" if item.role == "assistant" else "input_text"
                body["content"] = [{"type": kind, "text": item.content}]
            body.setdefault("type", "message")
            body.setdefault("id", f"{_ID_PREFIX[body['type']]}_{uuid.uuid4().hex}")
            body.setdefault("status", "completed")
            kept.append(body)
        return kept

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request that answers this one (FieldError naming this request's field)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "stream": self.stream,
        }
        given = {
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
            "response_format": self._response_format(),
            "logprobs": self.logprobs or None,
            "top_logprobs": (self.top_logprobs or 0) if self.logprobs else None,
        }
        body |= {name: value for name, value in given.items() if value is not None}
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": tool.model_dump(exclude={"type"})}
                for tool in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:  # the fields above are checked: what is left is input's
            raise FieldError("input", e.errors()[0]["msg"]) from None

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        for item in self.items():
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # its text, or calls
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.text()}
                )
        if not messages:
            raise FieldError("input", "input has no message (reasoning items alone)")
        return messages

    def _response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"type": "json_object"}
        if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
            schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            return {"type": "json_schema", "json_schema": schema}
        raise FieldError(
            "text.format",
            "text.format: type must be text, json_object or json_schema (with schema, an object)",
        )
