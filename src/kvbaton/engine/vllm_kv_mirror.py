"""vLLM's prefix cache as kvbaton's KV events (`--engine vllm`): what the KV router indexes.

- Each block vLLM stores is re-hashed from its token ids with kvbaton's chained hashing
  (`llm/hashing.py`), the cache salt in every block's keys as kvbaton's engine has it (vLLM
  keys the first block only): the router indexes a vLLM worker as it indexes its own engine's.
- vLLM's hash maps to kvbaton's with a count (vLLM may cache one hash in several blocks): a
  store is published when a hash enters, a removal when its last block leaves.
- A block is left out, with every block after it in its event, when the mirror lacks its
  parent, its size is not the engine's block size (a partial block), or it is keyed by more
  than a cache salt (LoRA, multimodal: kvbaton sends vLLM neither). Removals of blocks left
  out are ignored. The router then under-counts a hit; it never counts one vLLM lacks.
- `lost` (batches vLLM sent that never came) clears the mirror and says so (AllBlocksCleared).
- The dump lists the mirror, as of the last event published: there is no dump in vLLM.
- `cached_tokens` looks a prompt up in the mirror: what vLLM's prefix cache will give it, as far
  as the events that came say (one still on its way is not counted).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from kvbaton.llm.hashing import block_extra_keys, hash_blocks, reusable_blocks
from kvbaton.protocols.kv import AllBlocksCleared, BlockRemoved, BlockStored, KvDump, KvEvent

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Block:
    kv_hash: int
    salt: str | None
    copies: int = 1


class KvMirror:
    def __init__(self, block_size: int, on_event: Callable[[KvEvent], None]) -> None:
        self.block_size = block_size
        self._on_event = on_event
        self._blocks: dict[Hashable, _Block] = {}  # vLLM's hash -> kvbaton's
        self._kv_hashes: set[int] = set()  # kvbaton's hashes of `_blocks`
        self._next_event_id = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def stored(
        self,
        block_hashes: Sequence[Hashable],
        parent: Hashable | None,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: Sequence[tuple[Any, ...] | None] | None,
    ) -> None:
        """vLLM's BlockStored: its blocks, each `block_size` tokens, chained from `parent`."""
        if block_size != self.block_size or len(token_ids) != len(block_hashes) * block_size:
            return  # partial blocks
        if parent is None:
            first = extra_keys[0] if extra_keys else None
            if first is not None and not (len(first) == 1 and isinstance(first[0], str)):
                return  # keys other than a cache salt
            salt, kv_parent = first[0] if first else None, None
        elif (above := self._blocks.get(parent)) is not None:
            salt, kv_parent = above.salt, above.kv_hash
        else:
            log.debug("vLLM stored a block whose parent is not mirrored: left out")
            return
        keys = extra_keys or ()
        if any(key is not None for key in keys[1 if parent is None else 0 :]):
            return  # keys beyond the first block's salt: LoRA or multimodal
        kv_hashes = hash_blocks(token_ids, block_size, block_extra_keys(salt), kv_parent)
        run: list[int] = []  # new blocks in a row: one event each run
        for i, (vllm_hash, kv_hash) in enumerate(zip(block_hashes, kv_hashes, strict=True)):
            if (known := self._blocks.get(vllm_hash)) is not None:
                known.copies += 1
                self._stored_run(run, i, kv_hashes, kv_parent, token_ids)
                run = []
            else:
                self._blocks[vllm_hash] = _Block(kv_hash, salt)
                self._kv_hashes.add(kv_hash)
                run.append(kv_hash)
        self._stored_run(run, len(kv_hashes), kv_hashes, kv_parent, token_ids)

    def _stored_run(
        self,
        run: list[int],
        end: int,
        kv_hashes: list[int],
        kv_parent: int | None,
        token_ids: Sequence[int],
    ) -> None:
        """Publish the new blocks `run`, the last of which is block `end - 1` of the event."""
        if not run:
            return
        first = end - len(run)
        parent = kv_hashes[first - 1] if first else kv_parent
        size = self.block_size
        tokens = list(token_ids[first * size : end * size])
        self._emit(
            lambda i: BlockStored(
                event_id=i, block_hashes=run, parent_hash=parent, token_ids=tokens, block_size=size
            )
        )

    def removed(self, block_hashes: Sequence[Hashable]) -> None:
        """vLLM's BlockRemoved: one block of each hash left its cache."""
        gone: list[int] = []
        for vllm_hash in block_hashes:
            block = self._blocks.get(vllm_hash)
            if block is None:
                continue
            block.copies -= 1
            if not block.copies:
                del self._blocks[vllm_hash]
                self._kv_hashes.discard(block.kv_hash)
                gone.append(block.kv_hash)
        if gone:
            self._emit(lambda i: BlockRemoved(event_id=i, block_hashes=gone))

    def cleared(self) -> None:
        """vLLM's AllBlocksCleared (its prefix cache was reset)."""
        self._blocks.clear()
        self._kv_hashes.clear()
        self._emit(lambda i: AllBlocksCleared(event_id=i))

    def lost(self, batches: int) -> None:
        log.warning("KV events: %d batches from vLLM were lost; its blocks are forgotten", batches)
        self.cleared()

    def cached_tokens(self, token_ids: Sequence[int], salt: str | None) -> int:
        """The tokens at the head of `token_ids` (a prompt under `salt`) in blocks the mirror
        holds, of those a prefix cache can give (`reusable_blocks`)."""
        head = token_ids[: reusable_blocks(len(token_ids), self.block_size) * self.block_size]
        cached = 0
        for kv_hash in hash_blocks(head, self.block_size, block_extra_keys(salt)):
            if kv_hash not in self._kv_hashes:
                break
            cached += self.block_size
        return cached

    def dump(self) -> KvDump:
        return KvDump(
            last_event_id=self._next_event_id - 1,
            block_hashes=[block.kv_hash for block in self._blocks.values()],
        )

    def _emit(self, make: Callable[[int], KvEvent]) -> None:
        self._on_event(make(self._next_event_id))
        self._next_event_id += 1
