"""The engine's KV connector: what code that moves KV (disaggregation, KV tiers) sees of the
engine (docs/architecture.md, "The engine's KV connector").

- Scheduler side: `EngineRequest`'s `kv_source`, `hold_kv` and `kv_sink`; for an engine that
  moves KV itself (vLLM), `hold_kv` and `engine_params`, and the held output's `engine_params`.
- Worker side: `KvSource.load`, on a load thread of its own; `KvCacheView`.
- Tiers below the pool (`KvTier`, kv_tiers/): the engine offers it the full blocks it is about
  to reuse, and loads from it the prompt blocks it lacks that the tier has.
- A load ends exactly once, by return or exception; a failed one's blocks stay out of use
  until its `writes_end` is set.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvbaton.protocols.kv import KvDump, KvEvent
from kvbaton.protocols.llm import EngineOutput, KvTierStats, SamplingParams

# Number a KV event (`make(event_id)`) in the engine's stream and hand it on (any thread).
EmitEvent = Callable[[Callable[[int], KvEvent]], None]


@dataclass(frozen=True)
class KvLoad:
    """Load the prompt's KV of blocks `first_block...` (positions in the prompt's block table)
    into `dst_blocks`, local blocks in the same order. From a tier: `block_hashes`, the loaded
    blocks' hashes (full blocks only; the rest of the prompt is computed after)."""

    request_id: str
    source: KvSource
    first_block: int
    dst_blocks: list[int]
    block_hashes: list[int] = field(default_factory=list)


class KvLoadFailed(Exception):
    """The prompt's KV did not arrive; `token_ids` were sampled at the source all the same.
    `writes_end`: set once no write can land in the load's blocks (None: none can)."""

    def __init__(
        self,
        message: str,
        token_ids: list[int] | None = None,
        writes_end: threading.Event | None = None,
    ) -> None:
        super().__init__(message)
        self.token_ids = token_ids or []
        self.writes_end = writes_end


class KvSource(Protocol):
    """Where a request's prompt KV comes from: a peer, or local storage."""

    def load(self, load: KvLoad) -> list[int]:
        """(On a load thread; may block, ends within its own timeout.) Move the KV into
        `load.dst_blocks`; the tokens sampled at the source that the request did not come
        with. Raises (`KvLoadFailed`) if the KV did not arrive: the prompt is computed here."""
        ...


class KvTier(KvSource, Protocol):
    """Storage below the engine's pool: a block's KV by its chained hash.
    - `offload` copies what it keeps before it returns: the blocks are overwritten after.
    - `lookup` and `offload` run on the engine's thread and never wait on I/O.
    - It reports blocks it gains and loses as KV events of its tier (host, disk) through the
      `EmitEvent` it was built with, and adds what it holds to the engine's dump."""

    def lookup(self, block_hashes: list[int]) -> int:
        """How many of the leading blocks it holds (a later `load` may still miss)."""
        ...

    def offload(self, blocks: list[tuple[int, int]]) -> None:
        """Keep the KV of full blocks (hash, block id) that the pool is about to reuse."""
        ...

    def forget(self) -> None:
        """Drop what this process keeps of blocks (`clear_kv_blocks`)."""
        ...

    def stats(self) -> KvTierStats: ...

    def fill_dump(self, dump: KvDump) -> None:
        """Add the blocks it holds (as of the dump's last event)."""
        ...

    def close(self) -> None:
        """Stop: blocks still waiting to be written are written (within a bound) or dropped."""
        ...


@dataclass(frozen=True)
class PromptChunk:
    """Prompt tokens [start, end) computed in one step, in blocks `block_ids`: the sequence's
    blocks `first_block...` at that step."""

    start: int
    end: int
    first_block: int
    block_ids: list[int]


class KvSink(Protocol):
    def layer_written(self, chunk: PromptChunk, layer: int) -> None:
        """(On the engine's thread; must not block.) A step wrote layer `layer`'s K and V of
        `chunk`, layers in order; a chunk may be computed again after a preemption, in other
        blocks. The blocks stay the sequence's until its step ends, no longer."""
        ...


@dataclass
class EngineRequest:
    """One request for the engine. `output_token_ids`: sampled already (at the KV source)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    hold_kv: bool = False  # it ends after its first token, its blocks held until `release_kv`
    kv_source: KvSource | None = None  # admitted with blocks for the uncached part (`KvLoad`)
    kv_sink: KvSink | None = None  # told of each layer of its prompt's KV a step writes
    # Its prompt's KV at a peer engine that moves KV itself, in that engine's terms (vLLM's
    # kv_transfer_params from the prefill worker).
    engine_params: dict[str, Any] | None = None


class Staging(Protocol):
    def __call__(self, block_ids: list[int], layers: tuple[int, int] | None = None) -> None:
        """Copy blocks (of each, layers [first, end) if given) between cache and mirror."""


def _not_mirrored(block_ids: list[int], layers: tuple[int, int] | None = None) -> None:
    pass


@dataclass(frozen=True)
class KvCacheView:
    """The KV cache as a transfer layer sees it.
    - Peers move blocks in `buffer`; a block is `num_layers` equal parts, one per layer.
    - Where `buffer` mirrors the cache (a GPU's), `stage_out` copies blocks to it before they
      are read or sent, `stage_in` back after they were written or received."""

    layout: str  # dtype and block shape
    num_blocks: int
    block_bytes: int  # a block, all layers, contiguous; 0: blocks with no bytes (mocker)
    buffer: memoryview | None
    mirrored: bool = False
    stage_out: Staging = _not_mirrored
    stage_in: Staging = _not_mirrored
    num_layers: int = 1


class ConnectedEngine(Protocol):
    """What code that moves KV needs of an engine."""

    async def add_request(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]: ...
    def release_kv(self, request_id: str) -> None: ...
    def reclaim_kv_blocks(self) -> None: ...


async def outputs_of(
    engine: ConnectedEngine, request: EngineRequest
) -> AsyncGenerator[EngineOutput, None]:
    """The request's outputs; closing this early aborts it."""
    outputs = await engine.add_request(request)
    try:
        async for out in outputs:
            yield out
    finally:
        await outputs.aclose()
