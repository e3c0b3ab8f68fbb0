"""A decode worker's rooms (decode-first): a room whose request ends before its blocks were
announced ends at once; one whose blocks a prefill worker was given waits on for that writer's
report, or its timeout, so that the engine frees the blocks only once no write can land in
them; either way the room is forgotten."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvbaton.engine.engine import KvCacheView
from kvbaton.engine.scheduler import KvLoad, KvLoadFailed
from kvbaton.protocols.llm import KvPoolInfo
from kvbaton.workers.kv_handoff import KvHandoff

pytestmark = pytest.mark.unit


def make_handoff(timeout_s: float) -> KvHandoff:
    agent = SimpleNamespace(
        timeout_s=timeout_s,
        info=lambda: KvPoolInfo(layout="test", num_blocks=8, block_bytes=0, host=""),
        pool=SimpleNamespace(block_bytes=0),
        close=lambda: None,
    )
    engine = SimpleNamespace(release_kv=lambda handle: None)
    runtime = SimpleNamespace(instance_id=7)
    cache = KvCacheView("test", 8, 0, None)
    return KvHandoff(runtime, engine, agent, cache, "ns.backend", 4)  # type: ignore[arg-type]


@pytest.fixture
async def handoff() -> AsyncIterator[KvHandoff]:
    made = make_handoff(timeout_s=5.0)
    made.start()
    yield made
    await made.close()


async def admitted(handoff: KvHandoff, name: str) -> tuple[Any, asyncio.Task[list[int] | None]]:
    """A room, and the engine's load of its request waiting in it (on a load thread)."""
    room = handoff.open_room(name)
    load = asyncio.create_task(asyncio.to_thread(handoff.load, KvLoad(name, room, 0, [1, 2])))
    await asyncio.wait_for(room.allocated, 5)
    return room, load


async def test_a_room_closed_before_its_blocks_were_announced_ends_at_once(
    handoff: KvHandoff,
) -> None:
    room, load = await admitted(handoff, "r")
    handoff.close_room(room)
    with pytest.raises(KvLoadFailed):
        await asyncio.wait_for(load, 2)
    assert "r" not in handoff._rooms


async def test_an_announced_room_waits_for_its_writer_after_the_request_ended(
    handoff: KvHandoff,
) -> None:
    room, load = await admitted(handoff, "r")
    target = handoff.target(room)
    assert (target.room, target.block_ids) == ("r", [1, 2])
    handoff.close_room(room)  # the client left; the prefill worker may still write
    await asyncio.sleep(0.2)
    assert not load.done()
    answer = await handoff.kv_ready({"room": "r", "ok": False}, None)  # type: ignore[arg-type]
    assert answer == {"accepted": True}
    with pytest.raises(KvLoadFailed):
        await asyncio.wait_for(load, 2)
    assert "r" not in handoff._rooms


async def test_an_announced_room_nobody_reports_on_ends_at_its_timeout() -> None:
    handoff = make_handoff(timeout_s=0.3)
    handoff.start()
    try:
        room, load = await admitted(handoff, "r")
        handoff.target(room)
        handoff.close_room(room)
        with pytest.raises(KvLoadFailed):
            await asyncio.wait_for(load, 3)
        assert "r" not in handoff._rooms
        late = await handoff.kv_ready({"room": "r", "ok": True}, None)  # type: ignore[arg-type]
        assert late == {"accepted": False}
    finally:
        await handoff.close()
