"""The prefill side of a worker whose engine moves KV itself (vLLM's NIXL connector): no kvbaton
pool, no transfer agent, nothing held here.

- Prefill-first only: a decode-first `kv_target` is refused (ValueError).
- The answer to a held request carries its first token (none where the decode worker's
  engine samples it again: `VllmEngine`) and the engine's own transfer parameters
  (`DisaggregatedParams.engine_params`).
- The engine frees the blocks once they were read, or after its hold timeout: `kv_release`
  has nothing to free here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import msgspec

from kvbaton.engine.connector import ConnectedEngine, EngineRequest, outputs_of
from kvbaton.protocols.disagg import KvRelease, KvReleased
from kvbaton.protocols.llm import DisaggregatedParams, EngineOutput, KvPoolInfo, KvTarget
from kvbaton.runtime import Context, DistributedRuntime
from kvbaton.runtime.request_plane import Handler

ENGINE_POOL = KvPoolInfo(layout="engine", num_blocks=0, block_bytes=0, host="")


class EnginePrefillSide:
    agent = None  # no kvbaton transfer agent (see `LLMWorker.load`)
    handoffs = 0
    handoff_wait_s = 0.0
    ending: frozenset[asyncio.Future[object]] = frozenset()  # nothing ends after a request

    def __init__(
        self, runtime: DistributedRuntime, engine: ConnectedEngine, component: str, block_size: int
    ) -> None:
        """`component`: "namespace.component" of this worker."""
        self.runtime = runtime
        self.engine = engine
        self.component = component
        self.block_size = block_size

    def endpoints(self) -> dict[str, tuple[Handler, type]]:
        return {"kv_release": (self.kv_release, KvRelease)}

    async def close(self) -> None:
        pass

    def outputs(
        self, request: EngineRequest, target: KvTarget | None
    ) -> AsyncGenerator[EngineOutput, None]:
        if target is not None:
            raise ValueError("this worker's engine moves KV itself: prefill-first order only")
        request.hold_kv = True
        return self._holding(request)

    async def _holding(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        async with contextlib.aclosing(outputs_of(self.engine, request)) as outputs:
            async for out in outputs:
                if out.engine_params is None:  # it stopped at its first token
                    yield out
                    continue
                params = DisaggregatedParams(
                    prefill_instance_id=self.runtime.instance_id or 0,
                    prefill_component=self.component,
                    handle=out.request_id,
                    block_ids=[],
                    num_tokens=len(request.prompt_token_ids),
                    block_size=self.block_size,
                    first_token_ids=out.token_ids,
                    pool=ENGINE_POOL,
                    cached_tokens=out.usage.cached_tokens if out.usage else 0,
                    engine_params=out.engine_params,
                )
                yield msgspec.structs.replace(
                    out, kv_blocks=None, engine_params=None, disaggregated_params=params
                )

    async def kv_release(self, request: KvRelease, context: Context) -> KvReleased:
        """Endpoint: nothing is held here (the engine frees its blocks itself)."""
        return KvReleased(released=False)
