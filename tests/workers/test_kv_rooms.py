"""A decode worker's rooms (decode-first): a prefill worker claims a room before it writes. A
room nobody claimed ends when its request ends or its wait times out, and refuses a claim from
then on; a claimed room waits for its writer's report (or the router's), past the end of its
request and past the first timeout, so that the engine frees the blocks only once no write can
land in them; either way the room is forgotten."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvbaton.engine.engine import KvCacheView
from kvbaton.engine.scheduler import KvLoad, KvLoadFailed
from kvbaton.protocols.llm import KvPoolInfo
from kvbaton.workers import kv_handoff
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
    made = make_handoff(timeout_s=0.5)
    made.start()
    yield made
    await made.close()


async def admitted(handoff: KvHandoff, name: str) -> tuple[Any, asyncio.Task[list[int] | None]]:
    """A room whose blocks were announced, and the engine's load of its request waiting in it
    (on a load thread)."""
    room = handoff.open_room(name)
    load = asyncio.create_task(asyncio.to_thread(handoff.load, KvLoad(name, room, 0, [1, 2])))
    await asyncio.wait_for(room.allocated, 5)
    target = handoff.target(room)
    assert (target.room, target.block_ids) == (name, [1, 2])
    return room, load


async def call(handoff: KvHandoff, **request: object) -> bool:
    answer = await handoff.kv_ready(request, None)  # type: ignore[arg-type]
    return answer["accepted"]


async def test_an_unclaimed_room_ends_with_its_request_and_refuses_a_claim(
    handoff: KvHandoff,
) -> None:
    room, load = await admitted(handoff, "r")
    handoff.close_room(room)
    with pytest.raises(KvLoadFailed):
        await asyncio.wait_for(load, 2)
    assert "r" not in handoff._rooms
    assert not await call(handoff, room="r", claim=True)


async def test_an_unclaimed_room_ends_at_its_timeout(handoff: KvHandoff) -> None:
    _, load = await admitted(handoff, "r")
    with pytest.raises(KvLoadFailed):
        await asyncio.wait_for(load, 3)
    assert not await call(handoff, room="r", claim=True)


async def test_a_claimed_room_waits_for_its_writer_after_its_request_ended(
    handoff: KvHandoff,
) -> None:
    room, load = await admitted(handoff, "r")
    assert await call(handoff, room="r", claim=True)
    assert not await call(handoff, room="r", claim=True)  # one writer
    handoff.close_room(room)  # the client left; the prefill worker may still write
    await asyncio.sleep(1.0)  # twice the wait for a claim
    assert not load.done()
    assert await call(handoff, room="r", ok=False)
    with pytest.raises(KvLoadFailed):
        await asyncio.wait_for(load, 2)
    assert "r" not in handoff._rooms


async def test_a_claimed_room_takes_its_writers_tokens(handoff: KvHandoff) -> None:
    _, load = await admitted(handoff, "r")
    assert await call(handoff, room="r", claim=True)
    await asyncio.sleep(0.7)  # past the wait for a claim
    assert await call(handoff, room="r", ok=True, token_ids=[42])
    assert await asyncio.wait_for(load, 2) == [42]


async def test_a_claimed_room_nobody_reports_on_ends_at_the_long_timeout(
    handoff: KvHandoff, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_handoff, "CLAIMED_TIMEOUT_S", 0.5)
    room, load = await admitted(handoff, "r")
    assert await call(handoff, room="r", claim=True)
    handoff.close_room(room)
    with pytest.raises(KvLoadFailed):
        await asyncio.wait_for(load, 3)
    assert "r" not in handoff._rooms
    assert not await call(handoff, room="r", ok=True)
