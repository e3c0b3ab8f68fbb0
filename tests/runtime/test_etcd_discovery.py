"""What only etcd discovery does: lease expiry through etcd, outages (an etcd restarted or
stopped under live handles), a lease lost behind the backend's back, compaction under a watch.
Each test runs its own etcd, since these tests stop and restart it."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aetcd
import pytest

from kvbaton.runtime.discovery import PrefixWatch, WatchEvent, open_discovery
from kvbaton.runtime.discovery.etcd import EtcdDiscovery, EtcdUnavailableError
from tests.helpers import wait_until
from tests.servers import EtcdServer, free_port, running

pytestmark = pytest.mark.integration


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    with running(EtcdServer(tmp_path / "etcd")) as server:
        yield server


@pytest.fixture
def url(etcd: EtcdServer) -> str:
    return f"{etcd.url}/t-{uuid.uuid4().hex}"


@pytest.fixture
async def handles(url: str) -> AsyncIterator[list[EtcdDiscovery]]:
    """Three handles on one etcd, as three processes would have: writer, reader, other."""
    discs = [EtcdDiscovery.from_url(url) for _ in range(3)]
    yield discs
    for disc in discs:
        await disc.close()


@pytest.fixture
async def admin(etcd: EtcdServer) -> AsyncIterator[aetcd.Client]:
    """A plain etcd client, to act behind the backend's back."""
    async with aetcd.Client("127.0.0.1", etcd.port, timeout=5) as client:
        yield client


async def next_event(watch: PrefixWatch, timeout: float = 5.0) -> WatchEvent:
    return await asyncio.wait_for(watch.__anext__(), timeout)


async def test_keys_of_a_lease_no_longer_kept_alive_vanish_within_its_ttl(
    handles: list[EtcdDiscovery],
) -> None:
    writer, reader, _ = handles
    lease = await writer.grant_lease(2)
    await writer.put("/services/ns/c/ep-1", b"one", lease)
    watch = await reader.watch_prefix("/services/")
    assert watch.snapshot == {"/services/ns/c/ep-1": b"one"}
    task = writer._leases[lease].task
    assert task is not None
    task.cancel()  # the process hangs: no more keep-alives
    t0 = time.monotonic()
    assert await next_event(watch) == WatchEvent("delete", "/services/ns/c/ep-1", None)
    # Within the TTL of the last keep-alive, plus etcd's half-second expiry sweep.
    assert time.monotonic() - t0 < 2.0 + 0.75
    await watch.aclose()


async def test_watches_and_writes_carry_on_across_an_etcd_restart_and_outage(
    etcd: EtcdServer, handles: list[EtcdDiscovery]
) -> None:
    writer, reader, other = handles
    lease = await writer.grant_lease(10)
    await writer.put("/k/a", b"a", lease)
    watch = await reader.watch_prefix("/k/")
    await asyncio.to_thread(etcd.restart)
    # Written while the reader's watch stream is down or just back: delivered once resumed.
    await other.put("/k/b", b"b", await other.grant_lease(10))
    assert await next_event(watch, 10) == WatchEvent("put", "/k/b", b"b")

    await asyncio.to_thread(etcd.stop)
    t0 = time.monotonic()
    await writer.put("/k/c", b"c", lease)  # remembered, not an error
    late = await writer.grant_lease(10)  # a logical id now, an etcd lease when etcd is back
    await writer.put("/k/d", b"d", late)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(asyncio.TimeoutError):  # a watcher invents nothing while etcd is down
        await next_event(watch, 1.0)
    await asyncio.to_thread(etcd.start)
    back = {await next_event(watch, 10), await next_event(watch, 10)}
    assert back == {WatchEvent("put", "/k/c", b"c"), WatchEvent("put", "/k/d", b"d")}
    assert await reader.get_prefix("/k/") == {
        "/k/a": b"a",
        "/k/b": b"b",
        "/k/c": b"c",
        "/k/d": b"d",
    }
    assert writer._leases[late].etcd_id is not None
    await writer.revoke_lease(late)
    assert await next_event(watch) == WatchEvent("delete", "/k/d", None)
    await watch.aclose()


async def test_a_lost_lease_is_granted_again_with_every_key_under_the_same_id(
    url: str, handles: list[EtcdDiscovery], admin: aetcd.Client
) -> None:
    writer, reader, _ = handles
    lease = await writer.grant_lease(3)  # a keep-alive every second
    await writer.put("/k/a", b"a", lease)
    await writer.put("/k/b", b"b", lease)
    watch = await reader.watch_prefix("/k/")
    await admin.revoke_lease(lease)  # the logical id is the first etcd lease's id
    gone = {await next_event(watch), await next_event(watch)}
    assert gone == {WatchEvent("delete", "/k/a", None), WatchEvent("delete", "/k/b", None)}
    back = {await next_event(watch, 3), await next_event(watch, 3)}
    assert back == {WatchEvent("put", "/k/a", b"a"), WatchEvent("put", "/k/b", b"b")}
    new_etcd_id = writer._leases[lease].etcd_id
    assert new_etcd_id not in (None, lease)
    root = url.split("/", 3)[3]
    stored = await admin.get(f"/{root}/k/a".encode())
    assert stored is not None and stored.lease == new_etcd_id
    await writer.put("/k/c", b"c", lease)  # the logical id goes on working
    assert await next_event(watch) == WatchEvent("put", "/k/c", b"c")
    await writer.revoke_lease(lease)
    assert await reader.get_prefix("/k/") == {}
    await watch.aclose()


async def test_a_watch_behind_a_compaction_converges_on_the_current_keys(
    handles: list[EtcdDiscovery], admin: aetcd.Client
) -> None:
    writer, reader, _ = handles
    lease = await writer.grant_lease(10)
    await writer.put("/k/a", b"a", lease)
    await writer.put("/k/b", b"b", lease)
    watch = await reader.watch_prefix("/k/")
    (state,) = reader._watch_states
    assert state.task is not None
    state.task.cancel()  # the watch stream is down while keys change and etcd compacts
    await asyncio.gather(state.task, return_exceptions=True)
    await writer.delete("/k/a")
    await writer.put("/k/b", b"b2", lease)
    await writer.put("/k/c", b"c", lease)
    now = (await admin.get_prefix(b"/")).header.revision
    await admin.compact(now, physical=True)
    state.task = asyncio.create_task(reader._follow(state))  # resumes from a compacted revision
    events = [await next_event(watch) for _ in range(3)]
    assert sorted(events) == [
        WatchEvent("delete", "/k/a", None),
        WatchEvent("put", "/k/b", b"b2"),
        WatchEvent("put", "/k/c", b"c"),
    ]
    await writer.put("/k/d", b"d", lease)  # and then follows from the re-read revision on
    assert await next_event(watch) == WatchEvent("put", "/k/d", b"d")
    await watch.aclose()


async def test_the_first_grant_without_etcd_fails_clearly_in_bounded_time() -> None:
    url = f"etcd://127.0.0.1:{free_port()}/nobody-home"
    disc = open_discovery(url)
    t0 = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match=r"127\.0\.0\.1") as raised:
        await disc.grant_lease(10)
    assert isinstance(raised.value, ConnectionError)
    assert 4.0 < time.monotonic() - t0 < 6.5  # the 5 s bound
    t0 = time.monotonic()
    await disc.close()
    assert time.monotonic() - t0 < 1.0


async def test_reads_fail_and_close_returns_in_bounded_time_with_etcd_stopped(
    etcd: EtcdServer, url: str
) -> None:
    disc = EtcdDiscovery.from_url(url, connect_timeout=1.0)
    lease = await disc.grant_lease(10)
    await disc.put("/k/a", b"a", lease)
    watch = await disc.watch_prefix("/k/")
    await asyncio.to_thread(etcd.stop)
    await wait_until(lambda: not disc._online, timeout=5, what="the outage noticed")
    t0 = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match="could not read /k/"):
        await disc.get_prefix("/k/")
    assert time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    await asyncio.wait_for(disc.close(), 10)
    assert time.monotonic() - t0 < 3.0
    assert [e async for e in watch] == []


async def test_a_delete_during_the_put_of_its_key_wins(handles: list[EtcdDiscovery]) -> None:
    """The put's write is on its way when the delete comes: etcd ends without the key (the
    delete is not lost to the put's bookkeeping), and a put after it stays."""
    writer, reader, _ = handles
    lease = await writer.grant_lease(10)
    for i in range(20):
        key = f"/services/ns/c/race-{i}"
        await asyncio.gather(writer.put(key, b"v", lease), writer.delete(key))
        t0 = time.monotonic()
        while key in await reader.get_prefix("/services/ns/c/race-"):
            assert time.monotonic() - t0 < 5, f"{key} outlived its delete"
            await asyncio.sleep(0.05)
    await writer.put("/services/ns/c/race-last", b"kept", lease)
    assert await reader.get_prefix("/services/ns/c/race-last") == {
        "/services/ns/c/race-last": b"kept"
    }
