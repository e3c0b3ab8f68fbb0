"""The calls a disaggregated request makes between its workers, as typed messages
(`protocols/disagg.py`; docs/architecture.md).

- Never raise: each side has a timeout of its own for a call that never comes.
- One client per endpoint, kept until `close`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NamedTuple, TypeVar

import msgspec

from kvbaton.protocols.disagg import (
    Accepted,
    KvAbandon,
    KvClaim,
    KvClaimAnswer,
    KvReady,
    KvRelease,
    KvReleased,
)
from kvbaton.protocols.llm import DisaggregatedParams, KvTarget
from kvbaton.runtime import Client, DistributedRuntime, ResponseStream

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 5.0
# How long a decode worker waits for the report on a claimed room: the PrefillRouter's
# prefill timeout (`DEFAULT_PREFILL_TIMEOUT_S`).
CLAIMED_TIMEOUT_S = 300.0

_Answer = TypeVar("_Answer", bound=msgspec.Struct)


class Claimed(NamedTuple):
    """A claim the decode worker accepted."""

    stream: ResponseStream  # held open by the writer until it reported
    wait_s: float  # the decode worker waits for the report at least this long after the claim


class PeerCalls:
    def __init__(self, runtime: DistributedRuntime) -> None:
        self.runtime = runtime
        self._clients: dict[tuple[str, type], Client] = {}

    async def release(self, params: DisaggregatedParams) -> bool:
        """The prefill worker may free the blocks of `params`; whether it held them until now
        (False if freed before, by its hold timeout, or unanswered)."""
        endpoint = f"{params.prefill_component}.kv_release"
        answer = await self._call(
            endpoint, params.prefill_instance_id, KvRelease(handle=params.handle), KvReleased
        )
        return answer is not None and answer.released

    async def claim(self, target: KvTarget, timeout_s: float) -> Claimed | None:
        """Claim the blocks of `target` for writes that each end within `timeout_s`; None if
        refused, unanswered or answered amiss."""
        stream: ResponseStream | None = None
        claimed: Claimed | None = None
        try:
            client = await self._client(f"{target.decode_component}.kv_claim", KvClaimAnswer)
            request = KvClaim(room=target.room, timeout_s=timeout_s)
            stream = client.direct(request, target.decode_instance_id)
            answer = await asyncio.wait_for(anext(stream), CALL_TIMEOUT_S)
            if answer.accepted and answer.wait_s is not None:
                claimed = Claimed(stream, answer.wait_s)
        except (Exception, StopAsyncIteration) as exc:
            log.warning("kv_claim on %x failed: %r", target.decode_instance_id, exc)
        finally:
            if stream is not None and claimed is None:
                await stream.aclose()
        return claimed

    async def ready(self, target: KvTarget, report: KvReady) -> None:
        """Report on the decode worker's blocks of `target`."""
        endpoint = f"{target.decode_component}.kv_ready"
        await self._call(endpoint, target.decode_instance_id, report, Accepted)

    async def abandon(self, target: KvTarget) -> None:
        """No prefill worker will write into `target` unless one already claimed it."""
        endpoint = f"{target.decode_component}.kv_abandon"
        await self._call(endpoint, target.decode_instance_id, KvAbandon(room=target.room), Accepted)

    async def _client(self, endpoint: str, answer_type: type) -> Client:
        client = self._clients.get((endpoint, answer_type))
        if client is None:
            client = await self.runtime.endpoint(endpoint).client(response_type=answer_type)
            self._clients[endpoint, answer_type] = client
        return client

    async def _call(
        self, endpoint: str, instance_id: int, request: Any, answer_type: type[_Answer]
    ) -> _Answer | None:
        """The call's last answer; None if it failed."""
        answers: list[_Answer] = []
        try:
            client = await self._client(endpoint, answer_type)
            stream = client.direct(request, instance_id, timeout=CALL_TIMEOUT_S)
            async with stream:
                answers += [answer async for answer in stream]
        except Exception as exc:
            log.warning("%s on %x failed: %r", endpoint, instance_id, exc)
            return None
        return answers[-1] if answers else None

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
