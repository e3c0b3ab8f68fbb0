"""The OpenAI-compatible routes (step S1 in, S9 out).

Invariants: every error reaches the client in OpenAI's shape with its status, before streaming
starts, or as one error event after it started (then the stream closes without `[DONE]`); a
request whose client goes away (mid-stream or while a non-streaming answer is being built) is
cancelled at the worker; every request is counted once in the metrics with its final status."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Annotated, Any, Literal, Protocol

import msgspec
import pydantic
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from kvbaton.frontend import token_routes
from kvbaton.frontend.asgi import ASGIApp
from kvbaton.frontend.choices import Fork, PromptHome, fork_requests
from kvbaton.frontend.client_gone import ClientLeftError, EventStream, while_connected
from kvbaton.frontend.cluster import ClusterView
from kvbaton.frontend.dashboard_assets import ASSETS, HEADERS, asset
from kvbaton.frontend.errors import (
    ANTHROPIC_PREFIX,
    OpenAIError,
    as_openai_error,
    bad_request,
    from_validation_errors,
    model_not_found,
)
from kvbaton.frontend.fast_path import FastPath
from kvbaton.frontend.messages_api import CountTokensRequest, MessagesRequest
from kvbaton.frontend.messages_output import MessageStream
from kvbaton.frontend.metrics import FrontendMetrics
from kvbaton.frontend.models import ModelManager, ServedModel
from kvbaton.frontend.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    NvExt,
    TokenizeRequest,
    _Common,
)
from kvbaton.frontend.postprocess import ChoiceState, Delta
from kvbaton.frontend.preprocess import (
    ChatTools,
    build_requests,
    echoed_prompts,
    prompt_token_ids,
    thinking_budget,
)
from kvbaton.frontend.reasoning import ReasoningFormat
from kvbaton.frontend.response_store import StoredResponses, input_page
from kvbaton.frontend.responses import ResponseShape
from kvbaton.frontend.responses_api import ResponsesRequest
from kvbaton.frontend.responses_output import ResponseOutput, ResponseStream
from kvbaton.frontend.tool_calls import ToolCallFormat, format_of_template
from kvbaton.frontend.tools import ToolUse, tool_use
from kvbaton.protocols.llm import PreprocessedRequest
from kvbaton.protocols.stored_responses import StoredResponse

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
Event = tuple[int, ChoiceState, Delta]  # (choice index, its state, its new delta)
_LOOPBACK = frozenset({"127.0.0.1", "::1"})
LONG_REQUEST_BYTES = 8192  # bodies above this are templated and tokenized off the event loop


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        _encode(body), status_code=status, media_type="application/json", headers=headers
    )


class _Context:
    """What a request's choices share: its id, stop strings, reasoning format (a chat request
    on a frontend with a reasoning parser) and the text its answers continue (the final
    message's, with `continue_final_message`), tools (a chat request's), routing extensions,
    each prompt's echoed text (a completion request's, with `echo`; alone, with `max_tokens`
    0), and the workers that served it (named in the `x-kvbaton-worker` response header)."""

    __slots__ = (
        "continued",
        "echoes",
        "nvext",
        "prompt_only",
        "reasoning",
        "rid",
        "served_by",
        "stops",
        "tools",
    )

    def __init__(
        self,
        rid: str,
        stops: list[str],
        reasoning: ReasoningFormat | None,
        continued: str | None,
        tools: ToolUse | None,
        nvext: NvExt | None,
    ) -> None:
        self.rid = rid
        self.stops = stops
        self.reasoning = reasoning
        self.continued = continued
        self.tools = tools
        self.nvext = nvext
        self.echoes: list[str] = []  # by prompt; none: no echo
        self.prompt_only = False  # the echoes without the answers
        self.served_by: list[int] = []

    def headers(self) -> dict[str, str]:
        workers = ",".join(f"{w:x}" for w in dict.fromkeys(self.served_by))
        return {"x-kvbaton-worker": workers} if workers else {}


def _message_logprobs(state: ChoiceState, delta: Delta) -> list[dict[str, Any]]:
    """`delta`'s token logprobs in chat's shape (none unless the request asked for them)."""
    logprobs = state.chat_logprobs(delta)
    return logprobs["content"] if logprobs is not None else []


def _error_response(error: OpenAIError, path: str = "") -> Response:
    """`error` in the shape of the API `path` belongs to (OpenAI's but on Anthropic's routes)."""
    return Response(
        error.json_for(path),
        status_code=error.status,
        media_type="application/json",
        headers=error.headers,
    )


class Builder(Protocol):
    """An answer in another API's shape, built from the chat answer's deltas, whole or as its
    stream's events (`ResponseStream`, `MessageStream`)."""

    rid: str
    model: str

    def start(self, state: ChoiceState) -> list[bytes]: ...
    def update(self, delta: Delta, logprobs: list[dict[str, Any]]) -> list[bytes]: ...
    def finish(self, state: ChoiceState) -> list[bytes]: ...
    def whole(self, state: ChoiceState) -> dict[str, Any]: ...
    def response(self, state: ChoiceState) -> dict[str, Any]: ...
    def failed(self, error: OpenAIError) -> bytes: ...


@dataclasses.dataclass
class OtherApi:
    """A route answered in another API's shape than chat's (Responses, Anthropic's Messages)."""

    builder: Callable[[bool], Builder]  # its answer's builder (True: one that emits events)
    error: Callable[[OpenAIError], Response] = dataclasses.field(default=_error_response)
    done: Callable[[dict[str, Any]], None] | None = None  # given the whole answer


def anthropic_error_response(error: OpenAIError) -> Response:
    return _error_response(error, ANTHROPIC_PREFIX)


class RequestRecord:
    """One request's metrics: TTFT, inter-token latency, tokens, duration, final status; at its
    end, its TTFT and mean ITL to the cluster page's window."""

    def __init__(self, metrics: FrontendMetrics, model: str, route: str) -> None:
        self.m = metrics.of_model(model)
        self.window = metrics.window
        self.route = route
        self.started = self.first_token = self.last_token = time.monotonic()
        self.first = True
        self.generated = 0
        self.m.in_flight.inc()

    def tokens(self, n: int) -> None:
        if n == 0:
            return
        now = time.monotonic()
        self.generated += n
        self.m.output_tokens.inc(n)
        gaps = n
        if self.first:
            self.m.ttft.observe(now - self.started)
            self.first_token = now
            self.first = False
            gaps -= 1
        if gaps > 0:
            gap = (now - self.last_token) / gaps
            for _ in range(gaps):
                self.m.itl.observe(gap)
        self.last_token = now

    def done(self, status: int, prompt_tokens: int) -> None:
        self.m.in_flight.dec()
        self.m.requests(self.route, status).inc()
        self.m.input_tokens.inc(prompt_tokens)
        if status == 200:
            self.m.input_sequence_tokens.observe(prompt_tokens)
            self.m.output_sequence_tokens.observe(self.generated)
        self.m.duration.observe(time.monotonic() - self.started)
        ttft = None if self.first else self.first_token - self.started
        gaps = self.generated - 1
        itl = (self.last_token - self.first_token) / gaps if gaps > 0 else None
        self.window.record(status, ttft, itl)


class Frontend:
    def __init__(
        self,
        models: ModelManager,
        metrics: FrontendMetrics | None = None,
        reasoning: ReasoningFormat | None = None,
        tool_format: ToolCallFormat | None = None,
        stored: StoredResponses | None = None,
    ) -> None:
        """`reasoning`: chat answers' reasoning goes to `reasoning_content` (None: no split).
        `tool_format`: how every model writes tool calls (None: as its chat template does).
        `stored`: the Responses API's kept responses (None: this frontend's alone)."""
        self.models = models
        self.stored = stored or StoredResponses()
        self.metrics = metrics or FrontendMetrics()
        kept = self.stored.local
        self.metrics.follow_kept(lambda: len(kept), lambda: kept.bytes)
        self.reasoning = reasoning
        self.tool_format = tool_format
        self.cluster = ClusterView(models, self.metrics)
        self.api = self._build()  # every route, and /openapi.json
        self.app: ASGIApp = FastPath(  # the generation routes' well-formed requests go round it
            self.api,
            {
                "/v1/chat/completions": (ChatCompletionRequest, self._chat_completions),
                "/v1/completions": (CompletionRequest, self._completions),
                "/v1/responses": (ResponsesRequest, self._responses),
                "/v1/messages": (MessagesRequest, self._messages),
            },
        )

    # -- the request's path ----------------------------------------------------------------------
    def _served(self, name: str) -> ServedModel:
        served = self.models.get(name)
        if served is None:
            raise model_not_found(name)
        return served

    async def _choice(
        self,
        served: ServedModel,
        index: int,
        pre: PreprocessedRequest,
        ctx: _Context,
        fork: Fork | None = None,
        echo: str = "",
    ) -> AsyncGenerator[Event, None]:
        """A choice's events; one of a prompt's later choices is sent once its first choice's
        home is known (choices.py). `echo`: its prompt's echoed text."""
        state = ChoiceState(
            served.tokenizer,
            pre.token_ids,
            ctx.stops,
            ctx.reasoning,
            ctx.continued,
            ctx.tools,
            echo,
            ctx.prompt_only,
        )
        rid = ctx.rid if index == 0 else f"{ctx.rid}-{index}"
        if fork is not None and not fork.leads:
            await fork.home.wait()
        outputs = served.generate(pre, rid, ctx.served_by, ctx.nvext, fork)
        try:
            async for out in outputs:
                yield index, state, state.update(out)
                if state.finished:
                    break
        finally:
            await outputs.aclose()  # a stop string matched, or the client left: stop the worker
        if fork is not None and fork.leads:
            fork.home.found(None)  # it ended with no home: the others go where they are routed

    def _events(
        self, served: ServedModel, pres: list[PreprocessedRequest], n: int, ctx: _Context
    ) -> AsyncGenerator[Event, None]:
        """The events of every choice (`pres`: each prompt's `n` choices in index order)."""
        homes = [PromptHome() for _ in range(0, len(pres), n)]
        streams = [
            self._choice(
                served,
                i,
                pre,
                ctx,
                Fork(homes[i // n], i % n == 0) if n > 1 else None,
                ctx.echoes[i // n] if ctx.echoes else "",
            )
            for i, pre in enumerate(pres)
        ]
        return streams[0] if len(streams) == 1 else _merge(streams)

    async def _prompts(
        self, served: ServedModel, body: _Common, request: Request, tools: ChatTools | None
    ) -> list[list[int]]:
        """Template and tokenize; a long request on a thread, so that the event loop goes on
        serving the other requests' streams meanwhile."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > LONG_REQUEST_BYTES:
            return await asyncio.to_thread(prompt_token_ids, served.tokenizer, body, tools)
        return prompt_token_ids(served.tokenizer, body, tools)

    def _chat_tools(self, served: ServedModel, body: ChatCompletionRequest) -> ChatTools:
        """The format `served` writes tool calls in, and `body`'s use of its tools."""
        fmt = self._tool_format(served)
        return fmt, tool_use(body, fmt)

    def _tool_format(self, served: ServedModel) -> ToolCallFormat:
        """How the model writes tool calls: `--tool-call-parser`'s, else its template's."""
        if self.tool_format is not None:
            return self.tool_format
        return format_of_template(served.tokenizer.chat_template)

    async def _handle(
        self,
        request: Request,
        body: _Common,
        route: str,
        api: OtherApi | None = None,
    ) -> Response:
        """`api`: the other API whose request `body` answers (its answer is built from the chat
        answer's deltas; its errors in its shape). None: chat's or completions' own."""
        rid: str = request.state.request_id
        record: RequestRecord | None = None
        prompt_tokens = 0
        try:
            served = self._served(body.model)
            record = RequestRecord(self.metrics, body.model, route)  # arrived: TTFT runs
            chat = isinstance(body, ChatCompletionRequest)
            tools = (
                self._chat_tools(served, body) if isinstance(body, ChatCompletionRequest) else None
            )
            prompts = await self._prompts(served, body, request, tools)
            prompt_tokens = sum(len(p) for p in prompts)
            use = tools[1] if tools else None
            reasoning = self.reasoning if chat else None
            pres = build_requests(
                body,
                prompts,
                context_length=served.card.context_length,
                vocab_size=served.tokenizer.vocab_size,
                tools=use,
                thinking=(
                    thinking_budget(body, reasoning, served.tokenizer, prompts[0])
                    if isinstance(body, ChatCompletionRequest)
                    else None
                ),
            )
            pres = fork_requests(pres, body.n)
            continued = body.continued_text() if isinstance(body, ChatCompletionRequest) else None
            ctx = _Context(rid, body.stop_strings(), reasoning, continued, use, body.nvext)
            if isinstance(body, CompletionRequest) and body.echo:
                ctx.echoes = echoed_prompts(served.tokenizer, body)
                ctx.prompt_only = body.prompt_only
            events = self._events(served, pres, body.n, ctx)
            try:
                first = await anext(events)  # errors before any output get their own status
            except BaseException:
                await events.aclose()
                raise
        except Exception as exc:
            error = as_openai_error(exc, body.model)
            if error.status >= 500:
                log.warning("request %s failed: %s", rid, error.message)
            if record is not None:
                record.done(error.status, prompt_tokens)
            return (api.error if api else _error_response)(error)
        shape = ResponseShape(
            rid,
            body.model,
            chat,
            len(pres),
            reasoning is not None,
            body.n,
            body.echo_logprobs,
            body.shown_prompt_logprobs,
        )
        if body.stream:
            stream = (
                self._sse(shape, first, events, record, prompt_tokens, body.include_usage)
                if api is None
                else self._built_events(api, first, events, record)
            )
            return EventStream(stream, headers={"cache-control": "no-cache", **ctx.headers()})
        collect = (
            self._collect(shape, first, events, record)
            if api is None
            else self._collect_built(api, first, events, record)
        )
        if len(pres) == 1 and first[1].finished:  # all there: nothing left to wait for
            result = await collect
            record.done(200, prompt_tokens)
            return _json(result, headers=ctx.headers())
        try:
            result = await while_connected(request.receive, collect)
        except ClientLeftError:  # the workers were stopped
            record.done(499, prompt_tokens)
            return Response(status_code=499)
        except Exception as exc:
            error = as_openai_error(exc, body.model)
            record.done(error.status, prompt_tokens)
            return (api.error if api else _error_response)(error)
        record.done(200, prompt_tokens)
        return _json(result, headers=ctx.headers())

    async def _collect(
        self,
        shape: ResponseShape,
        first: Event,
        events: AsyncGenerator[Event, None],
        record: RequestRecord,
    ) -> dict[str, Any]:
        texts: list[list[str]] = [[] for _ in range(shape.n)]
        reasonings: list[list[str]] = [[] for _ in range(shape.n)]
        logprobs: list[list[Any]] = [[] for _ in range(shape.n)]
        states: dict[int, ChoiceState] = {}
        try:
            event: Event | None = first
            while event is not None:
                index, state, delta = event
                states[index] = state
                record.tokens(delta.tokens)
                texts[index].append(delta.text)
                reasonings[index].append(delta.reasoning)
                lp = shape.logprobs(state, delta)
                if lp is not None:
                    logprobs[index].append(lp)
                event = await anext(events, None)
        finally:
            await events.aclose()
        joined = ["".join(t) for t in texts]
        return shape.full(states, joined, ["".join(r) for r in reasonings], logprobs)

    async def _collect_built(
        self,
        api: OtherApi,
        first: Event,
        events: AsyncGenerator[Event, None],
        record: RequestRecord,
    ) -> dict[str, Any]:
        """Another API's answer, whole: built as its stream is (`_built_events`)."""
        stream = api.builder(False)
        try:
            event: Event | None = first
            state = first[1]
            while event is not None:
                _, state, delta = event
                record.tokens(delta.tokens)
                stream.update(delta, _message_logprobs(state, delta))
                event = await anext(events, None)
        finally:
            await events.aclose()
        whole = stream.whole(state)
        if api.done is not None:
            api.done(whole)
        return whole

    def _kept(self, output: ResponseOutput, response: dict[str, Any]) -> None:
        """`response` kept if its request asked (`store`)."""
        if output.request.store:
            stored = StoredResponse(response=response, input=output.request.kept_input())
            self.stored.put(output.id, stored)

    async def _sse(
        self,
        shape: ResponseShape,
        first: Event,
        events: AsyncGenerator[Event, None],
        record: RequestRecord,
        prompt_tokens: int,
        include_usage: bool,
    ) -> AsyncGenerator[bytes, None]:
        status = 499  # unless it ends one way or the other below
        states: dict[int, ChoiceState] = {}
        try:
            if shape.chat:
                for i in range(shape.n):
                    yield shape.sse(shape.role_chunk(i, include_usage))
            event: Event | None = first
            while event is not None:
                index, state, delta = event
                states[index] = state
                record.tokens(delta.tokens)
                if (
                    delta.text
                    or delta.reasoning
                    or delta.tool_calls
                    or delta.finish_reason
                    or delta.logprobs
                    or delta.prompt_logprobs
                ):
                    yield shape.chunk_event(state, index, delta, include_usage)
                event = await anext(events, None)
            if include_usage:
                yield shape.sse(shape.usage_chunk(states))
            yield b"data: [DONE]\n\n"
            status = 200
        except Exception as exc:
            error = as_openai_error(exc, shape.model)
            status = error.status
            log.warning("request %s failed mid-stream: %s", shape.rid, error.message)
            yield shape.sse(error.body())
        finally:
            await events.aclose()
            record.done(status, prompt_tokens)

    async def _built_events(
        self,
        api: OtherApi,
        first: Event,
        events: AsyncGenerator[Event, None],
        record: RequestRecord,
    ) -> AsyncGenerator[bytes, None]:
        """Another API's stream: its events as the choice's deltas come (`_sse`'s part)."""
        status = 499  # unless it ends one way or the other below
        stream = api.builder(True)
        prompt_tokens = first[1].prompt_tokens
        try:
            yield b"".join(stream.start(first[1]))
            event: Event | None = first
            state = first[1]
            while event is not None:
                _, state, delta = event
                record.tokens(delta.tokens)
                chunk = b"".join(stream.update(delta, _message_logprobs(state, delta)))
                if chunk:
                    yield chunk
                event = await anext(events, None)
            end = b"".join(stream.finish(state))
            if api.done is not None:  # before a next turn can ask for it
                api.done(stream.response(state))
            yield end
            status = 200
        except Exception as exc:
            error = as_openai_error(exc, stream.model)
            status = error.status
            log.warning("request %s failed mid-stream: %s", stream.rid, error.message)
            yield stream.failed(error)
        finally:
            await events.aclose()
            record.done(status, prompt_tokens)

    async def _chat_completions(self, request: Request, body: ChatCompletionRequest) -> Response:
        return await self._handle(request, body, "chat_completions")

    async def _responses(self, request: Request, body: ResponsesRequest) -> Response:
        if not self.stored.enabled:
            body = body.model_copy(update={"store": False})  # said so in the response
        try:
            if body.previous_response_id is not None:
                previous = await self.stored.get(body.previous_response_id, "previous_response_id")
                body = body.after(previous)
            chat = body.to_chat()
        except FieldError as exc:
            return _error_response(bad_request(str(exc), exc.param))
        except OpenAIError as exc:
            return _error_response(exc)
        output = ResponseOutput(request.state.request_id, body, self.stored.new_id())
        api = OtherApi(
            builder=lambda emits: ResponseStream(output, emits),
            done=lambda response: self._kept(output, response),
        )
        return await self._handle(request, chat, "responses", api)

    async def _messages(self, request: Request, body: MessagesRequest) -> Response:
        try:
            chat = body.to_chat()
        except FieldError as exc:
            return anthropic_error_response(bad_request(str(exc), exc.param))
        rid: str = request.state.request_id
        api = OtherApi(
            builder=lambda emits: MessageStream(rid, body, emits),
            error=anthropic_error_response,
        )
        return await self._handle(request, chat, "messages", api)

    async def _count_tokens(self, request: Request, body: CountTokensRequest) -> Response:
        try:
            chat = body.to_chat()
            served = self._served(body.model)
            (ids,) = await self._prompts(served, chat, request, self._chat_tools(served, chat))
        except FieldError as exc:
            return anthropic_error_response(bad_request(str(exc), exc.param))
        except Exception as exc:
            return anthropic_error_response(as_openai_error(exc, body.model))
        return _json({"input_tokens": len(ids)})

    async def _completions(self, request: Request, body: CompletionRequest) -> Response:
        return await self._handle(request, body, "completions")

    async def _answer(self, model: str, answer: Callable[[ServedModel], Any]) -> Response:
        """`answer(model's ServedModel)` (on a thread: tokenizing a long text takes a while), or
        its error in OpenAI's shape."""
        try:
            result = await asyncio.to_thread(answer, self._served(model))
        except pydantic.ValidationError as exc:
            return _error_response(from_validation_errors(exc.errors()))
        except Exception as exc:
            return _error_response(as_openai_error(exc, model))
        return _json(result)

    # -- the app -------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        app = FastAPI(title="kvbaton", summary="OpenAI-compatible LLM serving")

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, exc: HTTPException) -> Response:
            return _error_response(OpenAIError(exc.status_code, str(exc.detail)), request.url.path)

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError) -> Response:
            return _error_response(from_validation_errors(exc.errors()), request.url.path)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
            return await self._chat_completions(request, body)

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request) -> Response:
            return await self._completions(request, body)

        @app.post("/v1/responses")
        async def responses(body: ResponsesRequest, request: Request) -> Response:
            return await self._responses(request, body)

        @app.post("/v1/messages")
        async def messages(body: MessagesRequest, request: Request) -> Response:
            return await self._messages(request, body)

        @app.post("/v1/messages/count_tokens")
        async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
            return await self._count_tokens(request, body)

        @app.exception_handler(OpenAIError)
        async def openai_error(request: Request, exc: OpenAIError) -> Response:
            return _error_response(exc, request.url.path)

        @app.get("/v1/responses/{response_id}")
        async def get_response(
            response_id: str,
            stream: bool = False,
            starting_after: int | None = None,
            include: Annotated[list[str] | None, Query()] = None,
        ) -> Response:
            asked = {"stream": stream, "starting_after": starting_after is not None}
            for name, given in (asked | {"include": bool(include)}).items():
                if given:  # a background response's stream, or other items: none kept here
                    raise bad_request(f"{name}: a kept response is given whole", name)
            return _json((await self.stored.get(response_id, "response_id")).response)

        @app.delete("/v1/responses/{response_id}")
        async def delete_response(response_id: str) -> Response:
            await self.stored.delete(response_id, "response_id")
            return _json({"id": response_id, "object": "response", "deleted": True})

        @app.get("/v1/responses/{response_id}/input_items")
        async def list_input_items(
            response_id: str,
            limit: Annotated[int, Query(ge=1, le=100)] = 20,
            order: Literal["asc", "desc"] = "desc",
            after: str | None = None,
        ) -> Response:
            stored = await self.stored.get(response_id, "response_id")
            try:
                return _json(input_page(stored.input, limit, order, after))
            except KeyError:
                raise bad_request(f"no input item {after!r}", "after") from None

        @app.post("/tokenize")
        async def tokenize(body: TokenizeRequest) -> Response:
            return await self._answer(
                body.model, lambda m: token_routes.tokenize(m, body, self._tool_format(m))
            )

        @app.post("/detokenize")
        async def detokenize(body: DetokenizeRequest) -> Response:
            return await self._answer(body.model, lambda m: token_routes.detokenize(m, body))

        @app.get("/v1/models")
        async def list_models() -> Response:
            """OpenAI's list, with the fields Anthropic's clients page by (all on one page)."""
            data = [_model_entry(m) for m in self._sorted()]
            ids = [m["id"] for m in data] or [None]
            page = {"has_more": False, "first_id": ids[0], "last_id": ids[-1]}
            return _json({"object": "list", "data": data} | page)

        @app.get("/v1/models/{model_id:path}")
        async def get_model(model_id: str) -> Response:
            served = self.models.get(model_id)
            if served is None:
                return _error_response(model_not_found(model_id))
            return _json(_model_entry(served))

        @app.get("/health")
        async def health() -> Response:
            models = {m.name: [f"{i:x}" for i in m.instance_ids()] for m in self._sorted()}
            prefill = {m.name: [f"{i:x}" for i in m.prefill.live()] for m in self._sorted()}
            ready = any(models.values())
            body = {
                "status": "healthy" if ready else "unhealthy",
                "models": models,
                "prefill": {name: ids for name, ids in prefill.items() if ids},
            }
            return _json(body, 200 if ready else 503)

        @app.get("/busy_threshold")
        async def get_busy_threshold() -> Response:
            return _json(dataclasses.asdict(self.models.thresholds))

        @app.post("/busy_threshold")
        async def set_busy_threshold(request: Request) -> Response:
            """Change load shedding's thresholds (a JSON object of the fields to change). An
            operator's call: taken from this machine only (and with the API key, if set)."""
            if request.client is None or request.client.host not in _LOOPBACK:
                return _error_response(
                    OpenAIError(403, "thresholds are changed from the frontend's machine only")
                )
            try:
                changes = msgspec.json.decode(await request.body())
                if not isinstance(changes, dict):
                    raise ValueError("the body must be a JSON object of thresholds")
                self.models.thresholds.update(**changes)
            except (ValueError, msgspec.DecodeError) as exc:
                return _error_response(bad_request(str(exc)))
            log.info("busy thresholds now %s", self.models.thresholds)
            return _json(dataclasses.asdict(self.models.thresholds))

        @app.get("/live")
        async def live() -> Response:
            return _json({"status": "live"})

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/cluster")
        async def cluster() -> Response:
            """The workers, loads, recent requests, routing decisions, disaggregated transfers
            and planner decisions this frontend sees (docs/cluster.md)."""
            return _json(await self.cluster.snapshot())

        @app.get("/dashboard", include_in_schema=False)
        async def dashboard() -> Response:
            return _asset("index.html")

        @app.get("/dashboard/{name}", include_in_schema=False)
        async def dashboard_file(name: str) -> Response:
            return _asset(name)

        return app

    def _sorted(self) -> list[ServedModel]:
        return [self.models.models[n] for n in sorted(self.models.models)]


def _asset(name: str) -> Response:
    body = asset(name)
    if body is None:
        return _error_response(OpenAIError(404, f"no such file of the dashboard: {name}"))
    return Response(body, media_type=ASSETS[name], headers=HEADERS)


def _model_entry(served: ServedModel) -> dict[str, Any]:
    """A model in OpenAI's shape, and Anthropic's fields beside (`type` and those after it)."""
    created = served.card.created
    return {
        "id": served.name,
        "object": "model",
        "created": created,
        "owned_by": "kvbaton",
        "max_model_len": served.card.context_length,
        "type": "model",
        "display_name": served.name,
        "created_at": datetime.datetime.fromtimestamp(created, datetime.UTC).isoformat(),
        "max_input_tokens": served.card.context_length,
    }


async def _merge(streams: list[AsyncGenerator[Event, None]]) -> AsyncGenerator[Event, None]:
    """Events of several choices as they come; the first error stops them all."""
    queue: asyncio.Queue[Event | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[Event, None]) -> None:
        try:
            async for event in stream:
                await queue.put(event)
            await queue.put(None)
        except Exception as exc:
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
