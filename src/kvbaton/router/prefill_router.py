"""The PrefillRouter: picks a prefill worker (KV-aware) for a request, which answers with the
first token and where its KV waits (docs/architecture.md).

- A prefill worker's answer is read within `timeout_s`.
- Blocks held for a decode worker that never takes them are released (`router/disagg.py`),
  or the prefill worker's hold timeout frees them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbaton.disagg.peers import PeerCalls
from kvbaton.protocols.llm import EngineOutput, KvTarget, PreprocessedRequest
from kvbaton.router.policies import Router, RouteRequest, follow
from kvbaton.runtime import Client, DistributedRuntime

DEFAULT_PREFILL_TIMEOUT_S = 300.0
SETTLE_S = 2.0  # a decode-first prefill's time to end once its request has (`settle`)


class PrefillError(RuntimeError):
    """No prefill worker answered with the prompt's KV."""


@dataclass
class PrefillOutcomes:
    """A frontend's disaggregated prefills since it started (for `GET /v1/cluster`)."""

    answered: int = 0  # a prefill worker answered with the first token
    fallbacks: int = 0  # none did: the decode worker prefilled
    failures: int = 0  # none did, and the request failed (`enforce_disagg`)
    unsettled: int = 0  # decode-first: still running `SETTLE_S` after its request was answered


class PrefillRouter:
    def __init__(
        self,
        runtime: DistributedRuntime,
        client: Client,
        router: Router,
        timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S,
    ) -> None:
        """`client`: the prefill workers' `generate` endpoint; `router`: how to rank them."""
        self.client = client
        self.router = router
        self.timeout_s = timeout_s
        self.peers = PeerCalls(runtime)
        self.outcomes = PrefillOutcomes()
        self._abandoning: set[asyncio.Future[None]] = set()
        self._settling: set[asyncio.Task[EngineOutput | None]] = set()

    def instance_ids(self, with_cards: Sequence[int]) -> list[int]:
        """The live prefill workers among those with a card of the model."""
        live = set(self.client.instance_ids())
        return [i for i in with_cards if i in live]

    async def prefill(
        self,
        request: PreprocessedRequest,
        request_id: str,
        hints: RouteRequest,
        candidates: list[int],
        served_by: list[int],
    ) -> EngineOutput:
        """The prefill worker's answer: the first token, with `disaggregated_params` unless the
        request stopped there (or was written to a `kv_target`); no token where the decode
        worker's engine samples the first one itself (`engine_params`). PrefillError if none
        answered."""
        route = self.router.route(hints, candidates)
        stream = self.client.ordered(
            request, route.ranking, request_id=f"{request_id}-prefill", timeout=self.timeout_s
        )
        answer: EngineOutput | None = None
        try:
            async for out in follow(stream, route, served_by):  # one: the first token
                answer = out
        except Exception as exc:
            raise PrefillError(f"prefill failed: {exc}") from exc
        params = answer.disaggregated_params if answer is not None else None
        if answer is None or not (answer.token_ids or (params is not None and params.by_engine)):
            raise PrefillError("the prefill worker's answer ended without the first token")
        return answer

    def abandon(self, target: KvTarget, prefill: asyncio.Task[EngineOutput | None]) -> None:
        """A decode-first prefill that failed: end the decode worker's wait for `target` now,
        not at its timeout (one cancelled with its request is reported by its prefill
        worker once its writes ended; one that claimed the room is waited for there)."""
        if not prefill.cancelled() and (prefill.exception() or prefill.result() is None):
            abandoning = asyncio.ensure_future(self.peers.abandon(target))
            self._abandoning.add(abandoning)
            abandoning.add_done_callback(self._abandoning.discard)

    def settle(self, prefill: asyncio.Task[EngineOutput | None]) -> None:
        """A decode-first prefill still running when its request was answered whole.

        - It is counted if it ends within `SETTLE_S` (its answer came after the decode
          worker's last output, or its call failed after the decode worker gave up on its KV);
          else it is cancelled and counted as unsettled.
        - `close` cancels it, uncounted.
        """
        timed_out = False

        def deadline() -> None:
            nonlocal timed_out
            timed_out = True
            prefill.cancel()

        def ended(_: asyncio.Task[EngineOutput | None]) -> None:
            cancel.cancel()
            # Cancelled by the deadline; one that ended anyway (an answer in the same loop
            # turn: `wait_for` may keep it over the cancel) counted itself.
            if timed_out and prefill.cancelled():
                self.outcomes.unsettled += 1

        cancel = asyncio.get_running_loop().call_later(SETTLE_S, deadline)
        self._settling.add(prefill)
        prefill.add_done_callback(ended)
        prefill.add_done_callback(self._settling.discard)

    async def close(self) -> None:
        """Cancel the prefills left to settle and the abandon calls under way, then close."""
        pending: list[asyncio.Future[Any]] = [*self._settling, *self._abandoning]
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self.router.close()
        await self.peers.close()
