"""A chat request's tools: checked, put in the prompt, and forced by a grammar when asked.

- `tool_choice` "none" (or no tools): the prompt shows no tools and the answer is not parsed.
- "auto" (the default with tools): the model may call; its answer is parsed for calls.
- "required" or a named function: the answer is one call (more with `parallel_tool_calls`)
  in the model's format, its arguments valid against the function's schema by construction
  (a grammar the engine enforces); `finish_reason` is "tool_calls" for "required" and "stop"
  for a named function, as OpenAI's.
- A template that takes tools gets them (and the history's calls and results) as it expects;
  one that does not (SmolLM2's) gets `DEFAULT_TOOL_PROMPT` in its system message, and the
  history's calls and results written in the format's text.
- Every bad input is an `OpenAIError` (400) naming `tools`, `tool_choice` or `messages`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from kvbaton.frontend.errors import bad_request
from kvbaton.frontend.openai_types import ChatCompletionRequest, ChatMessage, Tool
from kvbaton.frontend.tool_calls import ToolCallFormat, ToolCallParser
from kvbaton.llm.constraints import grammar
from kvbaton.llm.json_schema import closed
from kvbaton.protocols.llm import Guided

DEFAULT_TOOL_PROMPT = """You can call functions, each described by a JSON schema in <tools></tools>:
<tools>
{tools}
</tools>
To call one, answer with exactly
{example}
where NAME is the function's name and the arguments follow its parameters' schema. To call \
several, write the calls one after another. Call a function only when it helps to answer."""


@dataclass(frozen=True)
class ToolUse:
    """What a request asks of tools (a request with tool_choice "none" or no tools has none).

    - `choice`: "auto", "required" or "named" (then `tools` holds the named function only).
    - `offered`: every tool of the request, shown in the prompt.
    """

    fmt: ToolCallFormat
    choice: str
    tools: list[Tool]
    offered: list[Tool]
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.fmt, None if self.parallel else 1)

    def finish_reason(self, reason: str, called: bool) -> str:
        """OpenAI's finish reason for an answer that ended with `reason`."""
        if reason == "stop" and called and self.choice != "named":
            return "tool_calls"
        return reason

    @functools.cached_property
    def guided(self) -> Guided | None:
        """The grammar of a forced call (None for "auto"); built once, when first asked."""
        if not self.forced:
            return None
        schemas = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool.function.name},
                    self.fmt.args_key: closed(tool.function.parameters) or {"type": "object"},
                },
                "required": ["name", self.fmt.args_key],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        parallel = self.parallel and self.choice == "required"
        return Guided(kind="grammar", spec=self.fmt.forced_grammar(schema, parallel))


def tool_use(request: ChatCompletionRequest, fmt: ToolCallFormat) -> ToolUse | None:
    """The request's use of tools, checked; None if it has none."""
    tools = request.tools or []
    choice = request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice other than none needs tools", "tool_choice")
        return None
    names = [tool.function.name for tool in tools]
    if len(set(names)) < len(names):
        raise bad_request("tools: two functions have the same name", "tools")
    for tool in tools:
        _check_schema(tool)
    if choice == "none":
        return None
    kind: str
    if choice is None or isinstance(choice, str):
        kind, chosen = choice or "auto", tools
    else:
        kind, chosen = "named", [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise bad_request(
                f"tool_choice: function {choice.function.name!r} is not among the tools",
                "tool_choice",
            )
    use = ToolUse(fmt, kind, chosen, tools, request.parallel_tool_calls)
    guided = use.guided
    if guided is not None:
        try:
            grammar(guided)
        except ValueError as exc:
            raise bad_request(f"tools: {exc}", "tools") from None
    return use


def _check_schema(tool: Tool) -> None:
    parameters = tool.function.parameters
    if parameters is None:
        return
    try:
        grammar(Guided(kind="json", spec=json.dumps(parameters)))
    except ValueError as exc:
        raise bad_request(
            f"tools: the parameters of {tool.function.name!r} are not a usable JSON schema: {exc}",
            "tools",
        ) from None


def template_inputs(
    request: ChatCompletionRequest,
    fmt: ToolCallFormat,
    use: ToolUse | None,
    takes_tools: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to render with the chat template (tools None: none passed)."""
    messages = [_message(m, fmt, takes_tools) for m in request.messages]
    if use is None:
        return messages, None
    tools = [tool.model_dump(exclude_none=True) for tool in use.offered]
    if takes_tools:
        return messages, tools
    prompt = DEFAULT_TOOL_PROMPT.format(
        tools="\n".join(json.dumps(t) for t in tools),
        example=fmt.write([("NAME", {"ARGUMENT": "VALUE"})]),
    )
    if messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{prompt}"
    else:
        messages.insert(0, {"role": "system", "content": prompt})
    return messages, None


def _message(message: ChatMessage, fmt: ToolCallFormat, takes_tools: bool) -> dict[str, Any]:
    text = message.text()
    out: dict[str, Any] = {"role": message.role, "content": text}
    if message.role == "tool":
        if takes_tools:
            out["tool_call_id"] = message.tool_call_id
        else:
            out["content"] = fmt.result.replace("{result}", text)
    elif message.tool_calls:
        calls = [(c.function.name, _arguments(c.function.arguments)) for c in message.tool_calls]
        if takes_tools:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": name, "arguments": args}}
                for c, (name, args) in zip(message.tool_calls, calls, strict=True)
            ]
        else:
            out["content"] = f"{text}\n{fmt.write(calls)}" if text else fmt.write(calls)
    return out


def _arguments(text: str) -> Any:
    """A history call's arguments as a JSON value (templates write them with `tojson`)."""
    try:
        return json.loads(text)
    except ValueError:
        raise bad_request(
            f"messages: a tool call's arguments are not JSON: {text[:80]!r}", "messages"
        ) from None
