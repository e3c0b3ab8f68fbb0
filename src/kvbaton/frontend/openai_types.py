"""The request bodies of the OpenAI API that the frontend accepts (pydantic: FastAPI validates
them and /openapi.json describes them).

Invariant: a field that is recognised but not supported is refused with a 400 naming it; a field
that is not recognised at all is refused too (as OpenAI does), except the few harmless ones in
`HARMLESS_FIELDS`. Nothing a client asks for is silently dropped."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal, Protocol, TypeVar, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from kvbaton.frontend.choices import MAX_CHOICES
from kvbaton.protocols.llm import Guided

# Taken and not used: who the caller is (`user`, `safety_identifier`), where OpenAI keeps
# things (`store`, `metadata`, `service_tier`), and prompt-cache hints (`prompt_cache_*`:
# kvbaton's prefix cache keys blocks by their tokens and keeps them while the pool has room).
HARMLESS_FIELDS = (
    "user",
    "safety_identifier",
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
)

PositiveInt = Annotated[int, Field(ge=1)]
INT64_MAX = 2**63 - 1  # the workers' messages carry 64-bit integers


class FieldError(ValueError):
    """A check across fields that blames one of them: `param` becomes the OpenAI error's
    (errors.py), where pydantic would name none."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    """A request body, or a part of one: fields not declared are refused."""

    model_config = ConfigDict(extra="forbid")


_B = TypeVar("_B", bound=BaseModel)


class _NullIsDefault(_Body):
    """A body with optional fields whose types take no None (a test holds every such body to
    this class).

    - A null given for one of those stands for the field's default: OpenAI's API takes nulls
      for its optional fields, and clients send them for fields left unset.
    - Bodies without such fields do without it: it costs a Python call per object validated.
    """

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = defaulted_on_null(cls)
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}


@functools.cache
def defaulted_on_null(cls: type[BaseModel]) -> frozenset[str]:
    """`cls`'s optional fields whose type refuses None."""
    return frozenset(
        name
        for name, field in cls.model_fields.items()
        if not field.is_required()
        and field.annotation is not Any
        and type(None) not in get_args(field.annotation)
    )


class _HasText(Protocol):
    @property
    def text(self) -> str: ...


def joined_text(content: str | Sequence[_HasText] | None) -> str:
    """A message's text: the string itself, its text parts joined, or "" for none."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def without(data: Any, ignored: tuple[str, ...]) -> Any:
    """A body without its `ignored` fields (harmless ones, taken and not used)."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if k not in ignored}
    return data


def validated_by_type(
    values: list[Any], models: dict[str, type[_B]], what: str, default: str | None = None
) -> list[_B]:
    """Each of `values` (a list of `what`s) validated as the model its `type` names (`default`
    where it has none), so that an error names the element and its fault."""
    out: list[_B] = []
    for i, value in enumerate(values):
        kind = value.get("type", default) if isinstance(value, dict) else None
        model = models.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise ValueError(
                f"{what} {i}: type {kind!r} is not supported ({', '.join(models)} are)"
            )
        out.append(validated(model, value, f"{what} {i} ({kind})"))
    return out


def validated(model: type[_B], value: Any, what: str, hint: str = "") -> _B:
    """`value` as a `model`; else a ValueError naming `what`, the faulty field and the fault,
    then `hint` (a part of a list, whose union's own error would say only which types fail)."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        fault = e.errors()[0]
        field = ".".join(str(p) for p in fault["loc"])
        where = f" field {field!r}" if field else ""
        raise ValueError(f"{what}{where}: {fault['msg']}{hint}") from None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallMessage(_NullIsDefault):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's: the call it answers
    reasoning_content: str | None = None  # an assistant's, as this server answers it (unused)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """- A list's parts are validated here, so an error names the part and its fault
        (the union's own error says only "Input should be a valid string")."""
        if not isinstance(content, list):
            return content
        parts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind != "text":
                raise ValueError(
                    f"a content part of type {kind!r} is not supported: the models served here "
                    "take text parts only"
                )
            hint = ' (a text part is {"type": "text", "text": "..."})'
            parts.append(validated(TextPart, part, f"content part {i}", hint))
        return parts

    @model_validator(mode="after")
    def _check_roles(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only one, has a tool_call_id")
        return self

    def text(self) -> str:
        return joined_text(self.content)


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionDefinition(_Body):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (none: no arguments)
    strict: bool | None = None  # the schema is enforced either way when the call is forced


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_NullIsDefault):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class RouterOverride(_Body):
    overlap_score_weight: Annotated[float, Field(ge=0)] | None = None
    router_temperature: Annotated[float, Field(ge=0)] | None = None


class NvExt(_Body):
    """Routing extensions, named as Dynamo names them."""

    backend_instance_id: Annotated[int, Field(ge=0)] | str | None = None  # int, or hex text
    router_config_override: RouterOverride | None = None

    def instance_id(self) -> int | None:
        value = self.backend_instance_id
        if not isinstance(value, str):
            return value
        try:
            return int(value, 16)
        except ValueError:
            raise ValueError(f"nvext.backend_instance_id {value!r} is not a hex id") from None


class _Common(_NullIsDefault):
    """Sampling and stopping, shared by both routes.

    - `cut_to_context` (a subclass's, never a body's): an output limit past the model's context
      is cut to the room the prompt leaves, not refused (Anthropic's Messages API, whose
      clients ask for more than most models hold)."""

    cut_to_context: ClassVar[bool] = False
    model: str
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1  # choices per prompt (choices.py)
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    # As OpenAI's: token id (a decimal string) -> a bias in [-100, 100] added to its logit.
    logit_bias: dict[str, float] | None = None
    nvext: NvExt | None = None
    # As vLLM's: a tenant's key that enters every block hash, so that requests with another
    # salt (or none) never hit this one's cached prefix blocks.
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # As vLLM's: the prompt's logprobs with this many alternatives, each prompt token's in the
    # whole response's `prompt_logprobs` (a completion's per choice); not streamed.
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Constraints enforced by the engine (vLLM's extension fields): at most one, and none with
    # a chat request's response_format json_object or json_schema.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value == "" or (isinstance(value, list) and "" in value):
            raise ValueError("a stop string cannot be empty")
        return value

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _check_salt(cls, value: Any) -> Any:
        if value is not None and not (isinstance(value, str) and value):
            raise ValueError("must be a non-empty string")
        return value

    @model_validator(mode="before")
    @classmethod
    def _drop_harmless(cls, data: Any) -> Any:
        return without(data, HARMLESS_FIELDS)

    @model_validator(mode="after")
    def _check_common(self) -> _Common:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed with stream=true")
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError("prompt_logprobs", "prompt_logprobs are not streamed: stream=false")
        if self.nvext is not None:
            self.nvext.instance_id()  # a bad id is a bad request
        return self

    def guided(self) -> Guided | None:
        """The request's constraint (ValueError if it asks for two)."""
        given = [
            Guided(kind=kind, spec=spec if isinstance(spec, str) else json.dumps(spec))
            for kind, spec in (
                ("json", self.guided_json),
                ("regex", self.guided_regex),
                ("choice", self.guided_choice),
                ("grammar", self.guided_grammar),
            )
            if spec is not None
        ]
        if len(given) > 1:
            raise ValueError("one constraint at most: guided_json, guided_regex, ...")
        return given[0] if given else None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token (0: only the chosen token's), None: no logprobs."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """... per prompt token after the first, as `num_logprobs`."""
        return self.prompt_logprobs

    @property
    def echo_logprobs(self) -> int | None:
        """Alternatives per echoed prompt token in a completion's `logprobs` (None: none)."""
        return None

    @property
    def shown_prompt_logprobs(self) -> int | None:
        """Alternatives per token in the response's `prompt_logprobs` field (None: no field):
        as asked, else as a completion's echo asks them (as vLLM gives them)."""
        return self.prompt_logprobs if self.prompt_logprobs is not None else self.echo_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # vLLM's
# OpenAI's answer length setting: "medium" is the model's own, the others are refused.
Verbosity = Literal["low", "medium", "high"]


class _TemplateInputs(_NullIsDefault):
    """The chat template's inputs beside the messages, as vLLM takes them: on a chat request and
    on /tokenize's messages.
    - `continue_final_message` ends the prompt inside the last message, for the answer to go on
      with it (without a generation prompt unless asked).
    - `reasoning_effort` reaches the template as a variable of that name, and as
      `enable_thinking` (false for "none": Qwen3's switch) unless `chat_template_kwargs` set it;
      a template that uses neither ignores it."""

    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None

    def template_variables(self) -> dict[str, Any]:
        """The variables the template is given beside its own inputs (see the class)."""
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables["reasoning_effort"] = self.reasoning_effort
            variables.setdefault("enable_thinking", self.reasoning_effort != "none")
        return variables


class ChatCompletionRequest(_TemplateInputs, _Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Recognised, not supported: refused when given a value that would need them.
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    verbosity: Verbosity | None = None
    thinking_token_budget: Annotated[StrictInt, Field(ge=-1)] | None = None  # vLLM's; -1: none
    # A subclass's, never a body's: False where clients send a budget whatever the model
    # (Anthropic's); an engine or frontend that cannot enforce it then goes on without it.
    budget_required: ClassVar[bool] = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        unsupported = [
            name
            for name in ("functions", "function_call", "audio", "prediction")
            if getattr(self, name)
        ]
        if self.modalities not in (None, ["text"]):
            unsupported.append("modalities")
        if self.verbosity not in (None, "medium"):
            unsupported.append("verbosity")
        if unsupported:
            raise FieldError(
                unsupported[0], f"{', '.join(unsupported)}: not supported by this server yet"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs=true")
        if self.continue_final_message:
            if "add_generation_prompt" not in self.model_fields_set:
                self.add_generation_prompt = False
            elif self.add_generation_prompt:
                raise FieldError(
                    "continue_final_message",
                    "continue_final_message and add_generation_prompt cannot both be true: the "
                    "answer goes on with the last message, it does not open a new one",
                )
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def continued_text(self) -> str | None:
        """The text the answer goes on with: the final message's, with
        `continue_final_message`; None: the answer starts a message."""
        return self.messages[-1].text() if self.continue_final_message else None

    def guided(self) -> Guided | None:
        """`response_format` json_object or json_schema (enforced whether `strict` or not),
        else an extension field's constraint."""
        constraint = super().guided()
        fmt = self.response_format or {"type": "text"}
        if fmt.get("type") == "text":
            return constraint
        if constraint is not None:
            raise ValueError("response_format and a guided_* field cannot go together")
        if fmt.get("type") == "json_object":
            return Guided(kind="json", spec='{"type": "object"}')
        schema = (
            (fmt.get("json_schema") or {}).get("schema")
            if fmt.get("type") == "json_schema"
            else None
        )
        if not isinstance(schema, dict):
            raise ValueError(
                "response_format: type must be text, json_object or json_schema (with "
                "json_schema.schema, an object)"
            )
        return Guided(kind="json", spec=json.dumps(schema))

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[list[int]], Field(min_length=1)]
    )
    # OpenAI's default for completions; 0 with `echo`: the prompt alone (vLLM's), scored with
    # `logprobs`
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: PositiveInt | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.best_of not in (None, 1):
            raise FieldError("best_of", "best_of > 1 is not supported")
        if self.best_of is not None and self.best_of < self.n:
            raise FieldError("best_of", "best_of must be at least n")
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "max_tokens 0 answers the prompt alone: it needs echo")
        if self.suffix:
            raise FieldError("suffix", "suffix is not supported by this server yet")
        return self

    @property
    def output_limit(self) -> int | None:
        return 1 if self.prompt_only else self.max_tokens  # one token, never shown

    @property
    def prompt_only(self) -> bool:
        """`max_tokens` 0 (with `echo`): each choice is its prompt, with no answer."""
        return self.max_tokens == 0

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The most of `prompt_logprobs` and the echoed prompt's (`echo` with `logprobs`)."""
        wanted = [n for n in (self.prompt_logprobs, self.echo_logprobs) if n is not None]
        return max(wanted, default=None)

    @property
    def echo_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None


_TEMPLATE_FIELDS = frozenset(_TemplateInputs.model_fields)


class TokenizeRequest(_TemplateInputs):
    """vLLM's /tokenize body: a `prompt`, tokenized as a completion request's, or `messages`,
    templated and tokenized as a chat request's with the same template fields and tools."""

    model: str
    prompt: str | None = None
    add_special_tokens: bool = True  # a prompt's (a chat template writes its own)
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check_form(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give a prompt or messages, one of them")
        misplaced = self.model_fields_set & (
            _TEMPLATE_FIELDS if self.messages is None else {"add_special_tokens"}
        )
        if misplaced:
            form = "messages" if self.messages is None else "a prompt"
            raise FieldError(min(misplaced), f"{', '.join(sorted(misplaced))}: only with {form}")
        return self

    def chat_request(self) -> ChatCompletionRequest | None:
        """The chat request these messages stand for (ValidationError as its own would be);
        None for a prompt."""
        if self.messages is None:
            return None
        fields = self.model_dump(include={*_TEMPLATE_FIELDS, "messages"}, exclude_unset=True)
        return ChatCompletionRequest.model_validate(fields | {"model": self.model})


class DetokenizeRequest(_Body):
    """vLLM's /detokenize body."""

    model: str
    tokens: list[int]
