"""Step S2: an OpenAI request to the `PreprocessedRequest`s a worker runs (chat template,
tokenization, validation against the model's context).

Invariant: every request that leaves here fits the model's context with its output limit, and
its sampling options are valid; anything else is an `OpenAIError` (400) naming the parameter."""

from __future__ import annotations

from collections.abc import Iterable

from kvbaton.frontend.errors import OpenAIError, bad_request
from kvbaton.frontend.openai_types import ChatCompletionRequest, CompletionRequest, _Common
from kvbaton.frontend.reasoning import ReasoningFormat, reasoning_start
from kvbaton.frontend.tool_calls import TOOL_CALL_FORMATS, ToolCallFormat
from kvbaton.frontend.tools import ToolUse, template_inputs
from kvbaton.llm.constraints import grammar
from kvbaton.llm.tokenizer import ReservedNameError, Tokenizer
from kvbaton.protocols.llm import Guided, PreprocessedRequest, SamplingParams, ThinkingBudget

ChatTools = tuple[ToolCallFormat, ToolUse | None]
CLOSED_TAIL = 4  # the prompt's last tokens where a template closes the reasoning (`_closes`)


def chat_prompt(
    tokenizer: Tokenizer,
    request: ChatCompletionRequest,
    fmt: ToolCallFormat,
    use: ToolUse | None,
) -> list[int]:
    """`fmt`: how the model writes tool calls (the history's are written so); `use`: the
    request's tools, shown in the prompt."""
    messages, tools = template_inputs(request, fmt, use, tokenizer.takes_tools)
    try:
        return tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            tools=tools,
            continue_final_message=request.continue_final_message,
            template_kwargs=request.template_variables(),
        )
    except ReservedNameError as exc:
        raise bad_request(f"chat_template_kwargs {exc}", "chat_template_kwargs") from None
    except ValueError as exc:  # no template, or no final message to continue
        raise bad_request(str(exc), "messages") from None
    except Exception as exc:  # the template itself refused (e.g. raise_exception on roles)
        raise bad_request(f"the chat template refused these messages: {exc}", "messages") from None


def completion_prompts(tokenizer: Tokenizer, request: CompletionRequest) -> list[list[int]]:
    prompt = request.prompt
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if all(isinstance(p, str) for p in prompt):
        return tokenizer.encode_batch(list(prompt))  # type: ignore[arg-type]
    return [list(p) for p in prompt]  # type: ignore[arg-type]


def echoed_prompts(tokenizer: Tokenizer, request: CompletionRequest) -> list[str]:
    """The text `echo` puts before each prompt's answers, in `completion_prompts`' order: a
    prompt given as text as given, one given as token ids decoded."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [tokenizer.decode(list(prompt))]  # type: ignore[arg-type]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    return [tokenizer.decode(list(p)) for p in prompt]  # type: ignore[arg-type]


def prompt_token_ids(
    tokenizer: Tokenizer, request: _Common, tools: ChatTools | None = None
) -> list[list[int]]:
    """The prompts of a chat or completion request, as token ids (one per choice); a chat
    request's with its tool format and use."""
    if isinstance(request, ChatCompletionRequest):
        fmt, use = tools or (TOOL_CALL_FORMATS["hermes"], None)
        return [chat_prompt(tokenizer, request, fmt, use)]
    assert isinstance(request, CompletionRequest)
    return completion_prompts(tokenizer, request)


def thinking_budget(
    request: ChatCompletionRequest,
    fmt: ReasoningFormat | None,
    tokenizer: Tokenizer,
    prompt: list[int],
) -> ThinkingBudget | None:
    """A chat request's `thinking_token_budget` for its `prompt`, with the tags of `fmt` (the
    frontend's reasoning format) as token ids; None where it asks none (-1: none) or its answer
    has no reasoning.

    - Each tag must be one token of the model's vocabulary (as reasoning models have them):
      the engine finds and places tags by id, and text spelled in other tokens would not match.
    - Where it cannot be enforced (no reasoning parser, tags that are not single tokens), a
      required budget is a 400 naming it; another is dropped.
    - The template may close the reasoning at the prompt's end (its thinking switched off): an
      answer that would start inside it then has none.
    """
    tokens = request.thinking_token_budget
    if tokens is None or tokens == -1:
        return None
    if fmt is None:
        why = "needs a frontend started with --reasoning-parser (which names the reasoning's tags)"
        _refuse_if_required(request, why)
        return None
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (fmt.start, fmt.end)]
    opening, closing = (i[0] if len(i) == 1 else None for i in ids)
    if opening is None or closing is None:
        why = f"needs a model whose tokenizer has {fmt.start} and {fmt.end} as single tokens"
        _refuse_if_required(request, why)
        return None
    continued = request.continued_text()
    start = reasoning_start(fmt, continued)
    if continued is None and fmt.implicit_start and _closes(prompt, opening, closing):
        start = None  # the template closed the reasoning: the answer has none
    if start is None:
        return None
    return ThinkingBudget(
        tokens=tokens,
        end=closing,
        start=opening if start else None,
        required=request.budget_required,
    )


def _refuse_if_required(request: ChatCompletionRequest, why: str) -> None:
    """A 400 naming the budget and saying `why` it cannot be enforced, if it is required."""
    if request.budget_required:
        raise bad_request(f"thinking_token_budget {why}", "thinking_token_budget")


def _closes(prompt: list[int], opening: int, closing: int) -> bool:
    """Whether the prompt ends by closing a reasoning it opened: its last `closing` is after its
    last `opening`, among its last `CLOSED_TAIL` tokens (a template's thinking switched off;
    not a tag in a message).
    """
    tail = prompt[-CLOSED_TAIL:]
    if closing not in tail:
        return False
    last = len(prompt) - tail[::-1].index(closing) - 1
    return opening in prompt[:last] and opening not in prompt[last:]


def build_requests(
    request: _Common,
    prompts: list[list[int]],
    *,
    context_length: int,
    vocab_size: int,
    tools: ToolUse | None = None,
    thinking: ThinkingBudget | None = None,
) -> list[PreprocessedRequest]:
    """`tools`: a chat request's, whose forced call is its constraint; `thinking`: its
    thinking budget, dropped under a constraint (which applies from the answer's first token:
    the answer has no reasoning)."""
    out = []
    check_token_ids(request.stop_token_ids or [], vocab_size, "stop_token_ids", "its items")
    for token_ids in prompts:
        n = len(token_ids)
        if n == 0:
            raise bad_request("the prompt is empty", "prompt")
        check_token_ids(token_ids, vocab_size, "prompt", "its items")
        guided = constraint(request, tools)
        bias = logit_bias(request)
        check_token_ids(bias, vocab_size, "logit_bias", "its keys")
        if n >= context_length:
            raise bad_request(
                f"This model's maximum context length is {context_length} tokens; the prompt "
                f"has {n} tokens (and at least one output token must fit).",
                "messages" if isinstance(request, ChatCompletionRequest) else "prompt",
            )
        limit = request.output_limit
        if limit is not None and n + limit > context_length and request.cut_to_context:
            limit = context_length - n
        if limit is not None and n + limit > context_length:
            raise bad_request(
                f"This model's maximum context length is {context_length} tokens; the prompt "
                f"has {n} tokens and {limit} more were asked for. Lower max_tokens.",
                "max_tokens",
            )
        out.append(
            PreprocessedRequest(
                model=request.model,
                token_ids=token_ids,
                sampling=sampling_params(
                    request,
                    limit or context_length - n,
                    bias,
                    guided,
                    thinking if guided is None else None,
                ),
                cache_salt=request.cache_salt,
            )
        )
    return out


def check_token_ids(ids: Iterable[int], vocab_size: int, param: str, what: str) -> None:
    """A 400 naming `param` unless every one of `ids` is in the vocabulary."""
    if any(t < 0 or t >= vocab_size for t in ids):
        raise bad_request(f"{param}: {what} must be token ids in [0, {vocab_size})", param)


def logit_bias(request: _Common) -> dict[int, float]:
    """The request's `logit_bias` with token ids as ints; 400 for a key that is not one."""
    try:
        return {int(token): bias for token, bias in (request.logit_bias or {}).items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids", "logit_bias") from None


def constraint(request: _Common, tools: ToolUse | None = None) -> Guided | None:
    """The request's constraint, checked (a 400 naming its field if it is invalid): a forced
    tool call's, or the one it asks for."""
    formatted = isinstance(request, ChatCompletionRequest) and request.response_format
    guided = None
    try:
        guided = request.guided()
        if tools is not None and tools.forced:
            if guided is not None:
                raise bad_request(
                    "tool_choice required or named cannot go with another constraint "
                    "(response_format, guided_*)",
                    "tool_choice",
                )
            return tools.guided
        if guided is not None:
            grammar(guided)
    except ValueError as exc:
        if formatted and formatted.get("type") != "text":
            field = "response_format"
        else:
            field = f"guided_{guided.kind}" if guided is not None else "guided_json"
        raise bad_request(str(exc), field) from None
    return guided


def sampling_params(
    request: _Common,
    max_tokens: int,
    bias: dict[int, float] | None = None,
    guided: Guided | None = None,
    thinking: ThinkingBudget | None = None,
) -> SamplingParams:
    given = {
        name: value
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
        )
        if (value := getattr(request, name)) is not None
    }
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        stop_token_ids=list(request.stop_token_ids or []),
        logprobs=request.num_logprobs,
        prompt_logprobs=request.num_prompt_logprobs,
        logit_bias=bias or {},
        guided=guided,
        thinking_budget=thinking,
        **given,
    )
    try:
        return params.validate()
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None
