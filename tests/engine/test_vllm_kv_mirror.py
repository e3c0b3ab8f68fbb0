"""The mirror of vLLM's prefix cache (`engine/vllm_kv_mirror.py`): vLLM's block events become
kvbaton's, re-hashed the way the KV router hashes a request, and the dump agrees with them."""

from __future__ import annotations

import pytest

from kvbaton.engine.vllm_kv_mirror import KvMirror
from kvbaton.llm.hashing import block_extra_keys, hash_blocks
from kvbaton.protocols.kv import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from kvbaton.router.indexer import KvIndexer

pytestmark = pytest.mark.unit
BS = 4
TOKENS = list(range(100, 124))  # 6 blocks


def mirror() -> tuple[KvMirror, list[KvEvent]]:
    events: list[KvEvent] = []
    return KvMirror(BS, events.append), events


def vllm_hashes(first: int, count: int) -> list[bytes]:
    """Stand-ins for vLLM's own hashes: opaque, unrelated to kvbaton's."""
    return [f"v{i}".encode() for i in range(first, first + count)]


def test_stored_blocks_are_re_hashed_as_the_router_hashes_the_prompt() -> None:
    """Two events, the second chained from the first's last block: the router's index, fed
    the mirror's events, matches all six blocks of the prompt."""
    m, events = mirror()
    h = vllm_hashes(0, 6)
    m.stored(h[:2], None, TOKENS[:8], BS, None)
    m.stored(h[2:], h[1], TOKENS[8:], BS, None)
    expected = hash_blocks(TOKENS, BS)
    assert [e.block_hashes for e in events if isinstance(e, BlockStored)] == [
        expected[:2],
        expected[2:],
    ]
    assert [e.event_id for e in events] == [0, 1]
    second = events[1]
    assert isinstance(second, BlockStored) and second.parent_hash == expected[1]
    index = KvIndexer()
    for event in events:
        index.apply(7, event)
    assert index.find_matches(expected) == {7: 6}
    assert m.dump().block_hashes == expected and m.dump().last_event_id == 1


def test_a_salt_keys_every_block_as_kvbaton_s_engine_does() -> None:
    """vLLM keys only the first block with the salt; kvbaton's hashes carry it in each."""
    m, _ = mirror()
    h = vllm_hashes(0, 6)
    m.stored(h[:3], None, TOKENS[:12], BS, [("s1",), None, None])
    m.stored(h[3:], h[2], TOKENS[12:], BS, None)
    salted = hash_blocks(TOKENS, BS, block_extra_keys("s1"))
    assert m.dump().block_hashes == salted
    assert salted != hash_blocks(TOKENS, BS)


def test_a_hash_cached_twice_is_removed_with_its_last_copy() -> None:
    """Two requests computed the same blocks: vLLM caches them twice and stores the later
    copy's events too (with a new block after them); the router hears of each block once,
    and of its removal when the last copy goes."""
    m, events = mirror()
    h = vllm_hashes(0, 3)
    m.stored(h[:2], None, TOKENS[:8], BS, None)
    m.stored(h, None, TOKENS[:12], BS, None)
    kv = hash_blocks(TOKENS[:12], BS)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [(e.block_hashes, e.parent_hash) for e in stored] == [(kv[:2], None), (kv[2:], kv[1])]
    assert stored[1].token_ids == TOKENS[8:12]
    m.removed(h[:2])
    assert not any(isinstance(e, BlockRemoved) for e in events)
    m.removed(h)
    (removed,) = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed.block_hashes == kv
    assert m.dump().block_hashes == [] and len(m) == 0


def test_blocks_it_cannot_re_hash_are_left_out() -> None:
    """An unknown parent, a partial block, keys beyond a salt (LoRA, multimodal): no event,
    and their removal is ignored."""
    m, events = mirror()
    h = vllm_hashes(0, 4)
    m.stored(h[1:2], b"unknown", TOKENS[4:8], BS, None)
    m.stored(h[2:3], None, TOKENS[:2], 2, None)
    m.stored(h[3:4], None, TOKENS[:4], BS, [("lora-a", "s1")])
    m.stored(h[:2], None, TOKENS[:8], BS, [None, ("mm-1", 0)])
    m.removed(h)
    assert events == [] and len(m) == 0


def test_cleared_or_lost_batches_forget_everything() -> None:
    m, events = mirror()
    h = vllm_hashes(0, 2)
    m.stored(h, None, TOKENS[:8], BS, None)
    m.cleared()
    assert isinstance(events[-1], AllBlocksCleared) and len(m) == 0
    m.stored(h, None, TOKENS[:8], BS, None)
    m.lost(3)
    assert isinstance(events[-1], AllBlocksCleared) and m.dump().block_hashes == []
    assert m.dump().last_event_id == events[-1].event_id == 3


def test_a_prompt_is_looked_up_as_vllm_s_prefix_cache_would_give_it() -> None:
    """Whole blocks from the head, under the prompt's salt, never the last token; what
    leaves or is cleared is no longer counted."""
    m, _ = mirror()
    h = vllm_hashes(0, 4)
    m.stored(h[:3], None, TOKENS[:12], BS, None)
    assert m.cached_tokens(TOKENS, None) == 12  # blocks 0-2 of 6
    assert m.cached_tokens(TOKENS[:12], None) == 8  # its last token is computed
    assert m.cached_tokens(TOKENS[:11], None) == 8
    assert m.cached_tokens(TOKENS[4:], None) == 0  # not from the head
    assert m.cached_tokens(TOKENS, "s1") == 0  # another salt
    m.stored(h[3:], None, TOKENS[:4], BS, [("s1",)])
    assert m.cached_tokens(TOKENS, "s1") == 4
    m.removed(h[1:2])
    assert m.cached_tokens(TOKENS, None) == 4  # block 1 left: block 2 is unreachable
    m.cleared()
    assert m.cached_tokens(TOKENS, None) == m.cached_tokens(TOKENS, "s1") == 0
