"""The LLM worker: one engine behind the endpoints `generate`, `clear_kv_blocks`, `load_metrics`
and `tokenizer_files` (`kv_events` and `kv_dump` when it publishes KV events; its side's
disaggregation endpoints), and a model card in discovery (docs/architecture.md).

- Roles: "agg" runs whole requests; "prefill" runs each to its first token and hands its KV
  on (`PrefillSide`); "decode", and "agg" given a `DecodeSide`, also take requests whose
  prompt's KV a prefill worker computes.
- A request for its prompt's logprobs is run whole, never disaggregated.
- A request's engine id is unique in this worker even when callers reuse a request id.
- A caller that goes away (cancel, disconnect, deadline) aborts its request in the engine, so
  its KV blocks are free before the engine's next step.
- An engine that fails (its step loop broke, vLLM's engine core died) stops the worker as a
  signal would (deregistered, drained), so that its supervisor starts a new one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from kvbaton.disagg.decode_side import DecodeSide
from kvbaton.disagg.engine_prefill import EnginePrefillSide
from kvbaton.disagg.prefill_side import PrefillSide
from kvbaton.engine.connector import ConnectedEngine, EngineRequest, outputs_of
from kvbaton.engine.engine import EngineStats
from kvbaton.kv_transfer.agent import TransferCounts
from kvbaton.llm.model_cards import model_card_key
from kvbaton.protocols.kv import KvDump
from kvbaton.protocols.llm import EngineOutput, ModelCard, PreprocessedRequest, WorkerLoad
from kvbaton.runtime import Context, DistributedRuntime
from kvbaton.runtime.request_plane import Handler
from kvbaton.workers.kv_publisher import KvEventPublisher

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


class ServingEngine(ConnectedEngine, Protocol):
    """What a worker needs of an engine (the built-in AsyncEngine, or a stand-in)."""

    @property
    def max_model_len(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def model_dir(self) -> Path: ...

    def stats(self) -> EngineStats: ...
    async def clear_kv_blocks(self) -> int: ...
    async def kv_dump(self) -> KvDump: ...
    async def wait_failed(self) -> str: ...
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
        side: PrefillSide | EnginePrefillSide | DecodeSide | None = None,
    ) -> None:
        """`kv_events`: the publisher the engine was given as its KV event callback; `side`:
        its side of disaggregation (a prefill worker's, or a decode or agg worker's; none
        where the engine moves KV itself, but a prefill worker's)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        if (role == "prefill") != isinstance(side, PrefillSide | EnginePrefillSide):
            raise ValueError("a prefill worker, and only one, takes a prefill side")
        self.runtime = runtime
        self.engine = engine
        self.kv_events = kv_events
        self.role = role
        self.side = side
        self.served_name = served_name
        self.namespace = namespace
        self.component = runtime.namespace(namespace).component(component)
        self._ids = itertools.count()
        self._failure: str | None = None  # why the engine failed
        self._ended: collections.Counter[str] = collections.Counter()  # requests, by how

    async def generate(
        self, request: PreprocessedRequest, context: Context
    ) -> AsyncIterator[EngineOutput]:
        """The role's handler: a prefill worker's, a decode worker's (for a request that comes
        with its KV's whereabouts) or the aggregated one."""
        engine_request = EngineRequest(
            f"{context.id}#{next(self._ids)}",  # unique here even when callers reuse an id
            request.token_ids,
            request.sampling,
            request.cache_salt,
        )
        handler = self._handler(request, engine_request)
        started = time.monotonic()
        generated, finish = 0, "cancelled"
        try:
            async with contextlib.aclosing(handler) as outputs:
                async for out in outputs:
                    generated += len(out.token_ids)
                    finish = out.finish_reason or finish
                    if out.disaggregated_params is not None or request.kv_target is not None:
                        finish = "handed off"
                    yield out
                    if out.finish_reason is None and context.is_stopped():
                        break
        except Exception:
            finish = "error"
            raise
        finally:
            self._ended[finish] += 1
            log.info(
                "request %s: %d prompt tokens, %d generated, %s, %.3fs",
                context.id,
                len(request.token_ids),
                generated,
                finish,
                time.monotonic() - started,
            )

    def _handler(
        self, request: PreprocessedRequest, engine_request: EngineRequest
    ) -> AsyncGenerator[EngineOutput, None]:
        """The request's handler; ValueError for a request this worker cannot take."""
        if request.model != self.served_name:
            raise ValueError(f"this worker serves {self.served_name!r}, not {request.model!r}")
        params, side = request.disaggregated_params, self.side
        disaggregated = isinstance(side, PrefillSide | EnginePrefillSide) or (
            params is not None or request.bootstrap
        )
        if disaggregated and request.sampling.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: the prompt is computed where it decodes, whole")
        if request.bootstrap and request.sampling.logprobs is not None:
            raise ValueError("logprobs: disaggregated prefill-first only (the first token's)")
        if isinstance(side, PrefillSide | EnginePrefillSide):
            if request.bootstrap or params is not None:
                raise ValueError("a prefill worker takes no bootstrap or disaggregated_params")
            return side.outputs(engine_request, request.kv_target)
        if request.kv_target is not None:
            raise ValueError("kv_target is for prefill workers")
        if params is not None:
            if request.bootstrap:
                raise ValueError("disaggregated_params come in the prefill-first order only")
            if params.num_tokens != len(request.token_ids) or not (
                params.first_token_ids or params.by_engine
            ):
                raise ValueError("disaggregated_params do not match the request's prompt")
            if params.by_engine and side is not None:
                raise ValueError("the prompt's KV waits in an engine this one cannot read")
        if side is None and request.bootstrap:
            raise ValueError("this worker takes no decode-first request (its engine has no side)")
        if side is None or (params is None and not request.bootstrap):
            # Prefilled here (with params: the tokens sampled there still count), or read by
            # the engine itself (`engine_params`).
            engine_request.output_token_ids = list(params.first_token_ids if params else [])
            engine_request.engine_params = params.engine_params if params else None
            return outputs_of(self.engine, engine_request)
        if params is not None:
            return side.fetched(engine_request, params)
        return side.bootstrapped(engine_request)

    def load(self) -> WorkerLoad:
        stats = dataclasses.asdict(self.engine.stats())
        side = self.side
        agent = side.agent if side else None
        moved = agent.counts() if agent else TransferCounts()
        return WorkerLoad(
            instance_id=self.runtime.instance_id or 0,
            kv_transfer_bytes=moved.bytes_moved,
            kv_transfer_seconds=moved.seconds,
            kv_transfer_bytes_by_backend=moved.bytes_by_backend,
            kv_layered_transfers=moved.layered_moves,
            kv_whole_blocks=moved.whole_blocks,
            kv_handoffs=side.handoffs if side else 0,
            kv_handoff_wait_seconds=side.handoff_wait_s if side else 0.0,
            requests_ended=dict(self._ended),
            **stats,
        )

    async def load_metrics(self, request: Any, context: Context) -> WorkerLoad:
        return self.load()

    async def kv_dump(self, request: Any, context: Context) -> KvDump:
        dump = await self.engine.kv_dump()
        dump.model = self.served_name
        return dump

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

    async def _stop_if_the_engine_fails(self) -> None:
        """Shut the runtime down (as a signal would) if the engine fails before it does."""
        failed = asyncio.ensure_future(self.engine.wait_failed())
        stopped = asyncio.ensure_future(self.runtime.wait_for_shutdown())
        try:
            await asyncio.wait((failed, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            stopped.cancel()
        if failed.done() and not failed.cancelled():
            self._failure = f"the engine failed: {failed.result()}"
            log.error("%s; the worker stops", self._failure)
            await self.runtime.shutdown()

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
            kv_pool=self.side.agent.info() if self.side and self.side.agent else None,
        )

    async def serve(self) -> str | None:
        """Publish the model card, then serve until the runtime shuts down, or the engine fails
        (which shuts the runtime down). Returns None, or why the engine failed."""
        try:
            instance_id = await self.runtime.ensure_instance_id()
            kv_stream = None
            if self.kv_events is not None:  # before the card: no card without its events
                kv_stream = await self.kv_events.sender(self.component, instance_id)
            key = model_card_key(self.namespace, self.served_name, instance_id)
            await self.runtime.publish(key, self.card(instance_id).to_json())
            endpoints: dict[str, tuple[Handler, Any]] = {  # name -> (handler, request type)
                "generate": (self.generate, PreprocessedRequest),
                "load_metrics": (self.load_metrics, Any),
                "clear_kv_blocks": (self.clear_kv_blocks, Any),
                "tokenizer_files": (self.tokenizer_files, Any),
                **(self.side.endpoints() if self.side is not None else {}),
            }
            endpoint = self.component.endpoint
            serving = [
                endpoint(name).serve_endpoint(handler, request_type=request_type)
                for name, (handler, request_type) in endpoints.items()
            ]
            serving.append(self._stop_if_the_engine_fails())
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
            if self.side is not None and self.side.ending:  # reports, releases
                await asyncio.wait(self.side.ending, timeout=ENDING_WAIT_S)
            await self.engine.shutdown()
            if self.side is not None:
                await self.side.close()
        return self._failure
