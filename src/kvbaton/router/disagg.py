"""A request's path through the workers once routed, disaggregated in either transfer order
(docs/architecture.md, "The disaggregation protocol").

- `Route.done()` once per route.
- The decode worker's route counts no prefill of the prompt there, until a prefill failure
  falls back to a prefill on the decode worker (or raises PrefillError with `enforce`).
- Blocks a prefill worker holds for a decode worker that never takes the request are
  released; a decode worker's room that no prefill worker will fill is ended at once.
- Decode-first: a prefill still running when its request ended is cancelled at once if the
  request ended early; else it is left `SETTLE_S` to end (`PrefillRouter.settle`), its outcome
  counted (a failure then is a fallback: the decode worker computed the prompt).
- A request that asks for logprobs goes prefill-first in either order: its first token's come
  with the prefill worker's answer (a decode worker takes no bootstrap for it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import msgspec

from kvbaton.protocols.llm import EngineOutput, PreprocessedRequest
from kvbaton.router.policies import Route, RouteRequest, follow
from kvbaton.router.prefill_router import PrefillError, PrefillRouter
from kvbaton.runtime import Client

log = logging.getLogger(__name__)

TRANSFER_ORDERS = ("prefill-first", "decode-first")


@dataclass
class Disaggregated:
    """One request's disaggregated path: the prefill workers to use, and its decode route."""

    prefill: PrefillRouter
    decode: Client  # the decode workers' `generate`
    request: PreprocessedRequest
    request_id: str
    hints: RouteRequest
    candidates: list[int]  # live prefill workers
    route: Route  # the decode workers, ranked
    served_by: list[int]
    enforce: bool  # a failed prefill fails the request (else: prefilled on the decode worker)

    def __post_init__(self) -> None:
        self.answered = False  # decode-first: the decode worker's last output came
        self.route.sent_kv()  # a prefill worker sends or writes it the KV

    def outputs(self, order: str) -> AsyncGenerator[EngineOutput, None]:
        if order == "decode-first" and self.request.sampling.logprobs is None:
            return self.decode_first()
        return self.prefill_first()

    async def prefill_first(self) -> AsyncGenerator[EngineOutput, None]:
        request, route = self.request, self.route
        params = None
        taken = False  # a decode worker produced output: it read (or released) the blocks
        try:
            route.start()  # its decode worker, chosen now, counts it during the prefill
            answer = await self._prefill(request)
            if answer is not None and answer.disaggregated_params is None:
                yield answer  # it stopped at its first token
                return
            if answer is not None:  # its first token, for the client
                params = answer.disaggregated_params
                request = msgspec.structs.replace(request, disaggregated_params=params)
                if answer.token_ids:  # (none: the decode worker's engine samples it)
                    yield msgspec.structs.replace(answer, usage=None, disaggregated_params=None)
            stream = self.decode.ordered(request, route.ranking, request_id=self.request_id)
            async for out in follow(stream, route, self.served_by):
                taken = True
                if params is not None and out.usage is not None:  # the prefill's cache hits
                    out.usage.cached_tokens = params.cached_tokens
                yield out
        finally:
            route.done()
            if params is not None and not taken:
                await self.prefill.peers.release(params)

    async def decode_first(self) -> AsyncGenerator[EngineOutput, None]:
        bootstrap = msgspec.structs.replace(self.request, bootstrap=True)
        stream = self.decode.ordered(bootstrap, self.route.ranking, request_id=self.request_id)
        outputs = follow(stream, self.route, self.served_by)
        pushing: asyncio.Task[EngineOutput | None] | None = None
        try:
            async for out in outputs:
                if out.kv_target is not None:
                    target = out.kv_target
                    pushed = msgspec.structs.replace(self.request, kv_target=target)
                    pushing = asyncio.create_task(self._prefill(pushed))
                    pushing.add_done_callback(functools.partial(self.prefill.abandon, target))
                    continue
                if pushing is not None and pushing.done() and not pushing.cancelled():
                    error = pushing.exception()
                    if error is not None:  # PrefillError with `enforce`
                        raise error
                self.answered = out.is_last
                yield out
        finally:
            if pushing is not None and not pushing.done():
                if self.answered:
                    self.prefill.settle(pushing)
                else:
                    pushing.cancel()
            await outputs.aclose()

    async def _prefill(self, request: PreprocessedRequest) -> EngineOutput | None:
        """The prefill worker's answer, or None (the decode worker prefills) if it failed."""
        outcomes = self.prefill.outcomes
        try:
            answer = await self.prefill.prefill(
                request, self.request_id, self.hints, self.candidates, self.served_by
            )
        except PrefillError as exc:
            if self.answered:  # the decode worker computed the prompt: the request was served
                outcomes.fallbacks += 1
                log.warning("request %s: %s after the decode worker answered", self.request_id, exc)
                return None
            if self.enforce:
                outcomes.failures += 1
                raise
            outcomes.fallbacks += 1
            log.warning("request %s: %s; prefilling on the decode worker", self.request_id, exc)
            self.route.sent_kv(False)
            return None
        outcomes.answered += 1
        return answer
