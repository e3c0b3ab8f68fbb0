"""The LLM worker: one engine behind the endpoints `generate`, `clear_kv_blocks`, `load_metrics`
and `tokenizer_files` (and `kv_events` and `kv_dump` when it publishes KV events, `kv_release`
as a prefill worker, `kv_claim` and `kv_ready` as a worker that decodes), and a model card in
discovery. On a NATS event plane its KV events and load go out on its subject instead of the
`kv_events` endpoint (`kv_dump` stays an endpoint).

Roles: "agg" runs whole requests; "prefill" runs each request to its first token and answers
with where its KV waits, or writes it where a decode worker waits for it (`kv_handoff.py`);
"decode" (and "agg" given a KV handoff) also takes requests whose prompt KV a prefill worker
computes, and reads it (prefill-first) or has it written into its blocks (decode-first).

Invariants: a request's engine id is unique in this worker even when callers reuse a request
id; a caller that goes away (cancel, disconnect, deadline) aborts its request in the engine, so
its KV blocks are free before the engine's next step."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from kvbaton.engine.engine import EngineStats
from kvbaton.engine.sequence import KvSink
from kvbaton.llm.model_cards import model_card_key
from kvbaton.protocols.kv import KvDump
from kvbaton.protocols.llm import (
    EngineOutput,
    ModelCard,
    PreprocessedRequest,
    SamplingParams,
    WorkerLoad,
)
from kvbaton.runtime import Context, DistributedRuntime
from kvbaton.workers.kv_handoff import KvFetch, KvHandoff
from kvbaton.workers.kv_publisher import KvEventPublisher
from kvbaton.workers.kv_push import LayerPush, RoomClaim
from kvbaton.workers.kv_room import KvRoom

log = logging.getLogger(__name__)
ENDING_WAIT_S = 30.0  # at shutdown, for requests' ends under way (each has its own timeouts)

ROLES = ("agg", "prefill", "decode")

# The files a frontend needs to tokenize and template for a model.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "config.json",
)


class ServingEngine(Protocol):
    """What a worker needs of an engine (the built-in AsyncEngine, or a stand-in)."""

    @property
    def max_model_len(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def model_dir(self) -> Path: ...

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        hold_kv: bool = False,
        kv_source: object = None,
        output_token_ids: list[int] | None = None,
        kv_sink: KvSink | None = None,
    ) -> AsyncGenerator[EngineOutput, None]: ...

    def release_kv(self, request_id: str) -> None: ...
    def stats(self) -> EngineStats: ...
    async def clear_kv_blocks(self) -> int: ...
    async def kv_dump(self) -> KvDump: ...
    async def shutdown(self) -> None: ...


class LLMWorker:
    def __init__(
        self,
        runtime: DistributedRuntime,
        engine: ServingEngine,
        *,
        served_name: str,
        namespace: str,
        component: str = "backend",
        kv_events: KvEventPublisher | None = None,
        role: str = "agg",
        handoff: KvHandoff | None = None,
    ) -> None:
        """`kv_events`: the publisher the engine was given as its KV event callback;
        `handoff`: the KV transfer of a prefill or decode worker (the engine's loader)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        if role == "prefill" and handoff is None:
            raise ValueError("a prefill worker needs a KV handoff")
        self.runtime = runtime
        self.engine = engine
        self.kv_events = kv_events
        self.role = role
        self.handoff = handoff
        self.served_name = served_name
        self.namespace = namespace
        self.component = runtime.namespace(namespace).component(component)
        self._ids = itertools.count()
        self._ending: set[asyncio.Future[None]] = set()  # requests' ends under way (shielded)

    async def generate(
        self, request: PreprocessedRequest, context: Context
    ) -> AsyncIterator[EngineOutput]:
        if request.model != self.served_name:
            raise ValueError(f"this worker serves {self.served_name!r}, not {request.model!r}")
        if request.kv_target is not None and self.role != "prefill":
            raise ValueError("kv_target is for prefill workers")
        if request.bootstrap and self.role == "prefill":
            raise ValueError("a prefill worker takes no bootstrap request")
        engine_id = f"{context.id}#{next(self._ids)}"
        started = time.monotonic()
        fetch = self._fetch(request)
        room = None
        if request.bootstrap and self.handoff is not None and self.role != "prefill":
            room = self.handoff.rooms.open_room(engine_id)
        pusher = claim = outputs = stream = None
        if request.kv_target is not None and self.handoff is not None:
            pusher = self.handoff.layer_push(engine_id, request.kv_target)
        generated = 0
        finish = "cancelled"
        try:
            outputs = await self.engine.add_request(
                engine_id,
                request.token_ids,
                request.sampling,
                lora_name=request.lora_name,
                cache_salt=request.cache_salt,
                hold_kv=self.role == "prefill",
                kv_source=room or self._readable(fetch),
                output_token_ids=fetch.params.first_token_ids if fetch else None,
                kv_sink=pusher if self.handoff and self.handoff.push_layers else None,
            )
            if pusher is not None:
                assert self.handoff is not None and request.kv_target is not None
                claim = self.handoff.claim(request.kv_target, pusher)
            stream = outputs if room is None else self._announced(room, outputs)
            async for out in stream:
                generated += len(out.token_ids)
                if request.kv_target is not None:
                    assert self.handoff is not None and claim and pusher
                    out = await self.handoff.push(engine_id, out, request.kv_target, claim, pusher)
                    finish = "pushed"
                elif out.kv_blocks is not None:
                    assert self.handoff is not None
                    out = await self.handoff.hold(engine_id, out, len(request.token_ids))
                    finish = "held"
                yield out
                if out.finish_reason is not None:
                    finish = out.finish_reason
                elif context.is_stopped():
                    break
        finally:
            # Shielded: a second cancellation (the drain's) must not cut the peers' part short.
            streams = [s for s in dict.fromkeys((stream, outputs)) if s is not None]
            ending = asyncio.ensure_future(self._end(streams, room, fetch, pusher, claim))
            self._ending.add(ending)
            ending.add_done_callback(self._ending.discard)
            try:
                await asyncio.shield(ending)
            finally:
                log.info(
                    "request %s: %d prompt tokens, %d generated, %s, %.3fs",
                    context.id,
                    len(request.token_ids),
                    generated,
                    finish,
                    time.monotonic() - started,
                )

    async def _end(
        self,
        streams: list[AsyncGenerator[EngineOutput, None]],
        room: KvRoom | None,
        fetch: KvFetch | None,
        pusher: LayerPush | None,
        claim: RoomClaim | None,
    ) -> None:
        """Whatever ended the request: no more writes to a decode worker's blocks, then the
        engine's request aborted (if unfinished: closing `streams`, outermost first), then the
        peers told."""
        if claim is not None:
            claim.cancel()  # (answered, unless the request ended first)
        if pusher is not None:  # before the abort frees the blocks it reads
            assert self.handoff is not None
            await self.handoff.stop_push(pusher)
        for stream in streams:
            try:
                await stream.aclose()
            except Exception:  # the peers must still be told
                log.exception("closing the engine's outputs failed")
        if claim is not None:  # (unless pushed) no more writes: the decode worker may go on
            await claim.report(False, [])
        if room is not None:
            assert self.handoff is not None
            self.handoff.rooms.close_room(room)
        if fetch is not None and self.handoff is not None:
            await self.handoff.release_remote(fetch)

    async def _announced(
        self, room: KvRoom, outputs: AsyncGenerator[EngineOutput, None]
    ) -> AsyncGenerator[EngineOutput, None]:
        """Decode-first: the engine's outputs, preceded by the room's `kv_target` once the engine
        gave the request its blocks (never, if its prompt was all cached here)."""
        assert self.handoff is not None
        first = asyncio.ensure_future(anext(outputs))
        try:
            either: list[asyncio.Future[Any]] = [room.allocated, first]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if room.allocated.done() and not room.allocated.cancelled():
                yield EngineOutput(
                    request_id=room.name, token_ids=[], kv_target=self.handoff.rooms.target(room)
                )
            yield await first
        finally:
            if not first.done():
                first.cancel()
                await asyncio.wait([first])  # `outputs` runs no more: it can be closed
        async for out in outputs:
            yield out

    def _fetch(self, request: PreprocessedRequest) -> KvFetch | None:
        """The request's KV source, if it comes with one (checked against the prompt)."""
        params = request.disaggregated_params
        if params is None:
            return None
        if self.role == "prefill":
            raise ValueError("a prefill worker takes no disaggregated_params")
        if request.bootstrap or request.kv_target is not None:
            raise ValueError("disaggregated_params come in the prefill-first order only")
        if params.num_tokens != len(request.token_ids) or not params.first_token_ids:
            raise ValueError("disaggregated_params do not match the request's prompt")
        return KvFetch(params)

    def _readable(self, fetch: KvFetch | None) -> KvFetch | None:
        """`fetch` if this worker can read it; else the prompt is computed here."""
        if fetch is None or (
            self.handoff is not None and fetch.params.block_size == self.engine.block_size
        ):
            return fetch
        log.info("KV of %s is not readable here; prefilling locally", fetch.params.handle)
        return None

    def load(self) -> WorkerLoad:
        stats = dataclasses.asdict(self.engine.stats())
        agent = self.handoff.agent if self.handoff else None
        return WorkerLoad(
            instance_id=self.runtime.instance_id or 0,
            kv_transfer_bytes=agent.bytes_moved if agent else 0,
            kv_transfer_seconds=agent.seconds if agent else 0.0,
            kv_handoffs=self.handoff.handoffs if self.handoff else 0,
            kv_handoff_wait_seconds=self.handoff.handoff_wait_s if self.handoff else 0.0,
            **stats,
        )

    async def load_metrics(self, request: Any, context: Context) -> WorkerLoad:
        return self.load()

    async def kv_dump(self, request: Any, context: Context) -> KvDump:
        return await self.engine.kv_dump()

    async def clear_kv_blocks(self, request: Any, context: Context) -> dict[str, int]:
        return {"cleared": await self.engine.clear_kv_blocks()}

    async def tokenizer_files(self, request: Any, context: Context) -> dict[str, bytes]:
        """The model's tokenizer and config files, for a frontend without the directory."""
        model_dir = self.engine.model_dir

        def read() -> dict[str, bytes]:
            return {
                name: (model_dir / name).read_bytes()
                for name in TOKENIZER_FILES
                if (model_dir / name).is_file()
            }

        return await asyncio.to_thread(read)

    async def _end_subscriptions(self, publisher: KvEventPublisher) -> None:
        try:
            await self.runtime.wait_for_shutdown()
        finally:
            publisher.close()

    def card(self, instance_id: int) -> ModelCard:
        model_dir = self.engine.model_dir
        path = self.component.endpoint("generate").path
        return ModelCard(
            name=self.served_name,
            endpoint=str(path),
            instance_id=instance_id,
            context_length=self.engine.max_model_len,
            kv_block_size=self.engine.block_size,
            model_path=str(model_dir.resolve()),
            tokenizer_files=[n for n in TOKENIZER_FILES if (model_dir / n).is_file()],
            created=int(time.time()),
            kv_events=self.kv_events is not None,
            role=self.role,
            kv_pool=self.handoff.agent.info() if self.handoff else None,
        )

    async def serve(self) -> None:
        """Publish the model card, then serve until the runtime shuts down."""
        try:
            instance_id = await self.runtime.ensure_instance_id()
            kv_stream = None
            if self.kv_events is not None:  # before the card: no card without its events
                kv_stream = await self.kv_events.sender(self.component, instance_id)
            key = model_card_key(self.namespace, self.served_name, instance_id)
            await self.runtime.publish(key, self.card(instance_id).to_json())
            endpoint = self.component.endpoint
            serving = [
                endpoint("generate").serve_endpoint(
                    self.generate, request_type=PreprocessedRequest
                ),
                endpoint("load_metrics").serve_endpoint(self.load_metrics),
                endpoint("clear_kv_blocks").serve_endpoint(self.clear_kv_blocks),
                endpoint("tokenizer_files").serve_endpoint(self.tokenizer_files),
            ]
            if self.handoff is not None:
                self.handoff.start()
                if self.role == "prefill":
                    serving.append(endpoint("kv_release").serve_endpoint(self.handoff.kv_release))
                else:
                    serving += [
                        endpoint("kv_claim").serve_endpoint(self.handoff.rooms.kv_claim),
                        endpoint("kv_ready").serve_endpoint(self.handoff.rooms.kv_ready),
                    ]
            if self.kv_events is not None:
                assert kv_stream is not None
                self.kv_events.start(self.load)
                serving += [
                    kv_stream(),
                    endpoint("kv_dump").serve_endpoint(self.kv_dump),
                    self._end_subscriptions(self.kv_events),
                ]
            await asyncio.gather(*serving)
        finally:
            # Requests in flight finish on the engine first (the runtime refuses new ones).
            await self.runtime.drained()
            if self._ending:  # their reports need the handoff, their aborts the engine
                await asyncio.wait(self._ending, timeout=ENDING_WAIT_S)
            await self.engine.shutdown()
            if self.handoff is not None:
                await self.handoff.close()
