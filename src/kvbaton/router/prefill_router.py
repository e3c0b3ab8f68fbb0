"""The PrefillRouter (steps S3-S6, prefill first): picks a prefill worker (KV-aware) for a
request, which computes the prompt's KV and answers with the first token and where its KV
waits (`DisaggregatedParams`); the caller then sends the request on to a decode worker with the
params injected.

Invariants: a prefill worker's answer is read within `timeout_s`; whatever happens after a
prefill worker answered with params and before a decode worker took them, the blocks are
released at the prefill worker (`release`), or its hold timeout frees them."""

from __future__ import annotations

from collections.abc import Sequence

from kvbaton.disagg.peers import PeerCalls
from kvbaton.protocols.llm import (
    DisaggregatedParams,
    EngineOutput,
    KvTarget,
    PreprocessedRequest,
)
from kvbaton.router.policies import Router, RouteRequest, follow
from kvbaton.runtime import Client, DistributedRuntime

DEFAULT_PREFILL_TIMEOUT_S = 300.0


class PrefillError(RuntimeError):
    """No prefill worker answered with the prompt's KV."""


class PrefillRouter:
    def __init__(
        self,
        runtime: DistributedRuntime,
        client: Client,
        router: Router,
        timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S,
    ) -> None:
        """`client`: the prefill workers' `generate` endpoint; `router`: how to rank them."""
        self.runtime = runtime
        self.client = client
        self.router = router
        self.timeout_s = timeout_s
        self.peers = PeerCalls(runtime)

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
        request stopped there (or was written to a `kv_target`). PrefillError if none
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
        if answer is None or not answer.token_ids:
            raise PrefillError("the prefill worker's answer ended without the first token")
        return answer

    async def release(self, params: DisaggregatedParams) -> None:
        """Free blocks that no decode worker will read."""
        await self.peers.release(params)

    async def abandon(self, target: KvTarget) -> None:
        """Tell a decode worker that no prefill worker will write into `target` (one that
        claimed it is waited for there: it may live on)."""
        await self.peers.abandon(target)

    async def close(self) -> None:
        await self.router.close()
        await self.peers.close()
