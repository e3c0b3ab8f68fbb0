"""Calls between the parties of a disaggregated request: telling a prefill worker that the
blocks it holds may go (`kv_release`), claiming a decode worker's blocks before writing them
and telling it whether the KV it waits for was written (`kv_release`'s decode-first twin,
`kv_ready`). Never raise: each side has a timeout of its own for a call that never comes."""

from __future__ import annotations

import logging
from typing import Any

from kvbaton.protocols.llm import DisaggregatedParams, KvTarget
from kvbaton.runtime import Client, DistributedRuntime

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 5.0


class PeerCalls:
    def __init__(self, runtime: DistributedRuntime) -> None:
        self.runtime = runtime
        self._clients: dict[str, Client] = {}

    async def release(self, params: DisaggregatedParams) -> None:
        """The prefill worker may free the blocks of `params`."""
        await self._call(
            params.release_endpoint, params.prefill_instance_id, {"handle": params.handle}
        )

    async def claim(self, target: KvTarget) -> bool:
        """Whether the decode worker lets us write into the blocks of `target` (it refuses
        once it stopped waiting for them)."""
        answer = await self._call(
            target.notify_endpoint, target.decode_instance_id, {"room": target.room, "claim": True}
        )
        return isinstance(answer, dict) and answer.get("accepted") is True

    async def kv_ready(self, target: KvTarget, ok: bool, token_ids: list[int]) -> None:
        """The decode worker's blocks of `target` hold the prompt's KV (`ok`), or will not;
        `token_ids`: sampled by the prefill worker (the first token)."""
        request = {"room": target.room, "ok": ok, "token_ids": token_ids}
        await self._call(target.notify_endpoint, target.decode_instance_id, request)

    async def _call(self, endpoint: str, instance_id: int, request: dict[str, Any]) -> Any:
        """The call's (last) answer; None if it failed."""
        answers: list[Any] = []
        try:
            client = self._clients.get(endpoint)
            if client is None:
                client = await self.runtime.endpoint(endpoint).client()
                self._clients[endpoint] = client
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
