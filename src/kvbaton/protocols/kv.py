"""KV events: what a worker's block pool reports so that routers can index its cache.

Every event carries the worker's `event_id`, a sequence number that increases by one per event
(per worker, from 0), so a consumer can detect a gap and ask for a full dump.
"""

from __future__ import annotations

import msgspec

from kvbaton.protocols.llm import WorkerLoad

DEVICE, HOST, DISK = "device", "host", "disk"  # a block's tier: the pool, or below it


class BlockStored(msgspec.Struct, tag="stored", kw_only=True, omit_defaults=True):
    """Full blocks became cached, in order: each one's parent is the one before it, the first
    one's parent is `parent_hash` (None at the start of a sequence). In a tier below the pool
    (`tier` host or disk) they come with no tokens and no parent (`block_size` 0); disk blocks
    are in `store`, shared by the workers of a host that name the same one."""

    event_id: int
    block_hashes: list[int]
    parent_hash: int | None
    token_ids: list[int]  # len(block_hashes) * block_size tokens
    block_size: int
    tier: str = DEVICE
    store: str | None = None


class BlockRemoved(msgspec.Struct, tag="removed", kw_only=True, omit_defaults=True):
    event_id: int
    block_hashes: list[int]
    tier: str = DEVICE
    store: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="cleared", kw_only=True):
    event_id: int


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvDump(msgspec.Struct, kw_only=True):
    """Every block a worker's cache holds, as of event `last_event_id` (-1: before any); with
    tiers, those of its host tier and of its disk `store` too.

    - `model`: the name the worker serves its model under ("": not said); a router indexes the
      workers of its own model only, where several models' workers share a component.
    """

    last_event_id: int
    block_hashes: list[int]
    host_block_hashes: list[int] = msgspec.field(default_factory=list)
    store: str | None = None
    store_block_hashes: list[int] = msgspec.field(default_factory=list)
    model: str = ""

    def of_another_model(self, model: str) -> bool:
        """Whether the worker serves another model than `model` ("" on either side: no)."""
        return bool(model and self.model and self.model != model)


class KvEventBatch(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One message of a worker's event stream: the KV events since the last message, in
    order, and its load when that changed. `last_event_id`: the id of the last event the worker
    had emitted when it sent this message (on a lossy event plane, a subscriber that is behind
    it lost events even if no later event comes to show the gap)."""

    events: list[KvEvent] = msgspec.field(default_factory=list)
    load: WorkerLoad | None = None
    last_event_id: int | None = None
