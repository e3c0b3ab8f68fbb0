"""Calls between the parties of a disaggregated request: telling a prefill worker that the
blocks it holds may go (`kv_release`), claiming a decode worker's blocks before writing them
(`kv_claim`, a stream the writer holds open until it reported), telling it whether the KV it
waits for was written (`kv_release`'s decode-first twin, `kv_ready`), or, from the router, that
no prefill worker will come for them. Never raise: each side has a timeout of its own for a
call that never comes."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, NamedTuple

from kvbaton.protocols.llm import DisaggregatedParams, KvTarget
from kvbaton.runtime import Client, DistributedRuntime, ResponseStream

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 5.0
# How long a decode worker waits for the report on a claimed room (at least, from the claim), as
# a bound for a writer that lives on but never reports: the PrefillRouter's prefill timeout. An
# acceptance that names no wait (`wait_s`, from kvbaton before it) means this.
CLAIMED_TIMEOUT_S = 300.0


class Accepted(NamedTuple):
    """A claim the decode worker accepted."""

    stream: ResponseStream  # held open by the writer until it reported
    wait_s: float  # the decode worker waits for the report at least this long after the claim
    takes_linger: bool  # its kv_ready reads `linger_s` (kvbaton before it set the blocks free)


def seconds(value: object, what: str) -> float:
    """`value` as a finite number of seconds, at least 0; ValueError naming `what` else."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ValueError(f"{what} is seconds (a finite number, at least 0), not {value!r}")
    return float(value)


class PeerCalls:
    def __init__(self, runtime: DistributedRuntime) -> None:
        self.runtime = runtime
        self._clients: dict[str, Client] = {}

    async def release(self, params: DisaggregatedParams) -> bool:
        """The prefill worker may free the blocks of `params`; whether it held them until now
        (False if they were freed before, by its hold timeout, or if it did not answer)."""
        answer = await self._call(
            params.release_endpoint, params.prefill_instance_id, {"handle": params.handle}
        )
        return isinstance(answer, dict) and answer.get("released") is True

    async def claim(self, target: KvTarget, timeout_s: float) -> Accepted | None:
        """Claim the blocks of `target`, for writes that each end within `timeout_s`: the
        acceptance if the decode worker lets us write into them (it refuses once it stopped
        waiting). None if refused, unanswered or answered amiss."""
        stream: ResponseStream | None = None
        accepted: Accepted | None = None
        try:
            client = await self._client(target.claim_endpoint)
            request = {"room": target.room, "timeout_s": timeout_s}
            stream = client.direct(request, target.decode_instance_id)
            answer = await asyncio.wait_for(anext(stream), CALL_TIMEOUT_S)
            if isinstance(answer, dict) and answer.get("accepted") is True:
                wait_s = seconds(answer.get("wait_s", CLAIMED_TIMEOUT_S), "wait_s")
                if not wait_s:
                    raise ValueError("its acceptance says no wait (wait_s=0)")
                accepted = Accepted(stream, wait_s, answer.get("linger") is True)
        except (Exception, StopAsyncIteration) as exc:
            log.warning("kv_claim on %x failed: %s", target.decode_instance_id, exc)
        finally:
            if stream is not None and accepted is None:
                await stream.aclose()
        return accepted

    async def kv_ready(
        self, target: KvTarget, ok: bool, token_ids: list[int], linger_s: float = 0.0
    ) -> None:
        """The decode worker's blocks of `target` hold the prompt's KV (`ok`), or will not;
        `token_ids`: sampled by the prefill worker (the first token); `linger_s`: a write that
        failed may still land in them for this long."""
        request = {"room": target.room, "ok": ok, "token_ids": token_ids, "linger_s": linger_s}
        await self._call(target.notify_endpoint, target.decode_instance_id, request)

    async def abandon(self, target: KvTarget) -> None:
        """No prefill worker will write into `target` unless one already claimed it."""
        request = {"room": target.room, "abandon": True}
        await self._call(target.notify_endpoint, target.decode_instance_id, request)

    async def _client(self, endpoint: str) -> Client:
        client = self._clients.get(endpoint)
        if client is None:
            client = await self.runtime.endpoint(endpoint).client()
            self._clients[endpoint] = client
        return client

    async def _call(self, endpoint: str, instance_id: int, request: dict[str, Any]) -> Any:
        """The call's (last) answer; None if it failed."""
        answers: list[Any] = []
        try:
            client = await self._client(endpoint)
            stream = client.direct(request, instance_id, timeout=CALL_TIMEOUT_S)
            async with stream:
                answers += [answer async for answer in stream]
        except Exception as exc:
            log.warning("%s on %x failed: %s", endpoint, instance_id, exc)
            return None
        return answers[-1] if answers else None

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
