"""The discovery contract, run against every backend (etcd on the session's etcd server, under a
key prefix of its own per test; kubernetes on the session's API stand-in, in a namespace of its
own); then what only file discovery does."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvbaton.runtime.discovery import (
    Discovery,
    FileDiscovery,
    PrefixWatch,
    WatchEvent,
    open_discovery,
)
from kvbaton.runtime.discovery.etcd import EtcdDiscovery
from tests.helpers import wait_until
from tests.servers import EtcdServer, KubeStandIn

pytestmark = pytest.mark.unit


@pytest.fixture(params=["mem", "file", "etcd", "kubernetes"])
async def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "mem":
        return f"mem://{uuid.uuid4().hex}"
    if request.param == "etcd":
        server: EtcdServer = request.getfixturevalue("etcd_server")
        return f"{server.url}/t-{uuid.uuid4().hex}"
    if request.param == "kubernetes":
        kube: KubeStandIn = request.getfixturevalue("kube_standin")
        return kube.url(f"t-{uuid.uuid4().hex[:12]}")
    return f"file://{tmp_path / 'disc'}"


@pytest.fixture
async def pair(url: str) -> AsyncIterator[tuple[Discovery, Discovery]]:
    """Two handles on one store: a writer and a reader, as two processes would have."""
    a, b = open_discovery(url), open_discovery(url)
    yield a, b
    await a.close()
    await b.close()


async def next_event(watch: PrefixWatch, timeout: float = 5.0) -> WatchEvent:
    return await asyncio.wait_for(watch.__anext__(), timeout)


async def test_put_get_delete(pair: tuple[Discovery, Discovery]) -> None:
    writer, reader = pair
    lease = await writer.grant_lease(10)
    await writer.put("/services/ns/c/ep-1", b"one", lease)
    await writer.put("/services/ns/c/ep-2", b"two", lease)
    await writer.put("/models/ns/m/1", b"card", lease)
    assert await reader.get_prefix("/services/ns/") == {
        "/services/ns/c/ep-1": b"one",
        "/services/ns/c/ep-2": b"two",
    }
    await writer.delete("/services/ns/c/ep-1")
    await writer.delete("/services/ns/c/missing")
    assert await reader.get_prefix("/services/") == {"/services/ns/c/ep-2": b"two"}


async def test_watch_gives_snapshot_then_changes_in_order(
    pair: tuple[Discovery, Discovery],
) -> None:
    writer, reader = pair
    lease = await writer.grant_lease(10)
    await writer.put("/services/ns/c/ep-1", b"one", lease)
    watch = await reader.watch_prefix("/services/ns/c/")
    try:
        assert watch.snapshot == {"/services/ns/c/ep-1": b"one"}
        await writer.put("/services/ns/c/ep-2", b"two", lease)
        assert await next_event(watch) == WatchEvent("put", "/services/ns/c/ep-2", b"two")
        await writer.put("/services/other/c/ep-9", b"not watched", lease)
        await writer.put("/services/ns/c/ep-2", b"two again", lease)
        assert await next_event(watch) == WatchEvent("put", "/services/ns/c/ep-2", b"two again")
        await writer.delete("/services/ns/c/ep-1")
        assert await next_event(watch) == WatchEvent("delete", "/services/ns/c/ep-1", None)
    finally:
        await watch.aclose()


async def test_revoking_a_lease_removes_its_keys_only(pair: tuple[Discovery, Discovery]) -> None:
    writer, reader = pair
    doomed, kept = await writer.grant_lease(10), await writer.grant_lease(10)
    await writer.put("/k/a", b"a", doomed)
    await writer.put("/k/b", b"b", kept)
    watch = await reader.watch_prefix("/k/")
    try:
        await writer.revoke_lease(doomed)
        assert await next_event(watch) == WatchEvent("delete", "/k/a", None)
        assert await reader.get_prefix("/k/") == {"/k/b": b"b"}
    finally:
        await watch.aclose()


async def test_close_revokes_every_lease(pair: tuple[Discovery, Discovery]) -> None:
    writer, reader = pair
    await writer.put("/k/a", b"a", await writer.grant_lease(10))
    await writer.close()
    assert await reader.get_prefix("/k/") == {}


async def test_put_needs_a_held_lease(pair: tuple[Discovery, Discovery]) -> None:
    writer, _ = pair
    with pytest.raises(KeyError):
        await writer.put("/k/a", b"a", 12345)


# -- file discovery only -------------------------------------------------------------------


def _expire(root: Path, lease_id: int) -> None:
    """Make a lease look as if its owner stopped keeping it alive long ago."""
    path = root / ".leases" / f"{lease_id:x}"
    past = time.time() - 3600
    os.utime(path, (past, past))


async def test_file_keys_of_a_dead_lease_vanish_for_readers(tmp_path: Path) -> None:
    root = tmp_path / "disc"
    writer, reader = FileDiscovery(root), FileDiscovery(root)
    lease = await writer.grant_lease(10)
    await writer.put("/services/ns/c/ep-1", b"one", lease)
    watch = await reader.watch_prefix("/services/")
    try:
        assert watch.snapshot == {"/services/ns/c/ep-1": b"one"}
        # The writer "dies": no more keep-alives, and its lease is older than its TTL.
        assert writer._keepalive_task is not None
        writer._keepalive_task.cancel()
        _expire(root, lease)
        assert await next_event(watch, timeout=3.0) == WatchEvent(
            "delete", "/services/ns/c/ep-1", None
        )
        assert not (root / "services/ns/c/ep-1").exists()  # the reader reaped the files
    finally:
        await watch.aclose()
        await reader.close()
        writer._own.clear()
        await writer.close()


async def test_file_lease_expires_on_time_without_any_file_event(tmp_path: Path) -> None:
    root = tmp_path / "disc"
    writer, reader = FileDiscovery(root), FileDiscovery(root)
    ttl = 1.0
    lease = await writer.grant_lease(ttl)
    await writer.put("/k/a", b"a", lease)
    assert writer._keepalive_task is not None
    writer._keepalive_task.cancel()
    born = (root / ".leases" / f"{lease:x}").stat().st_mtime
    watch = await reader.watch_prefix("/k/")
    try:
        assert await next_event(watch, timeout=3.0) == WatchEvent("delete", "/k/a", None)
        seen = time.time()
        assert born + ttl <= seen <= born + ttl + 0.5
    finally:
        await watch.aclose()
        await reader.close()
        writer._own.clear()
        await writer.close()


async def test_file_keep_alive_restores_keys_reaped_while_stalled(tmp_path: Path) -> None:
    root = tmp_path / "disc"
    writer, reader = FileDiscovery(root), FileDiscovery(root)
    lease = await writer.grant_lease(0.4)
    await writer.put("/k/a", b"a", lease)
    # A peer reaps the writer's files as if it had stalled past its TTL.
    (root / ".leases" / f"{lease:x}").unlink()
    (root / "k" / "a").unlink()
    assert await reader.get_prefix("/k/") == {}
    await asyncio.sleep(0.3)  # longer than one keep-alive interval (TTL / 4)
    assert await reader.get_prefix("/k/") == {"/k/a": b"a"}
    await reader.close()
    await writer.close()


@pytest.mark.parametrize("key", ["no-slash", "/a/../b", "/a//b", "/a/.hidden", "/a/b/"])
def test_file_refuses_keys_that_would_escape_or_hide(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match="invalid discovery key"):
        FileDiscovery(tmp_path)._key_path(key)


def test_open_discovery_urls(tmp_path: Path) -> None:
    assert isinstance(open_discovery(f"file://{tmp_path}"), FileDiscovery)
    assert isinstance(open_discovery(str(tmp_path)), FileDiscovery)
    with pytest.raises(ValueError, match="unknown discovery backend"):
        open_discovery("zookeeper://x")


def test_open_discovery_etcd_urls() -> None:
    disc = open_discovery("etcd://10.0.0.1:2381,etcd-b,[::1]:2390/kvb/prod/")
    assert isinstance(disc, EtcdDiscovery)
    assert disc.root == "/kvb/prod"
    assert disc._full("/services/a") == b"/kvb/prod/services/a"
    assert disc._strip(b"/kvb/prod/services/a") == "/services/a"
    assert [c._host for c in disc._clients] == ["10.0.0.1", "etcd-b", "[::1]"]
    assert [c._port for c in disc._clients] == [2381, 2379, 2390]
    bare = open_discovery("etcd://127.0.0.1:2379")
    assert isinstance(bare, EtcdDiscovery)
    assert bare.root == "" and bare._range("") == (b"\0", b"\0")


async def test_closing_wakes_a_reader_waiting_on_the_watch(url: str) -> None:
    disc = open_discovery(url)
    watches = [await disc.watch_prefix("/a/"), await disc.watch_prefix("/b/")]

    async def read(watch: PrefixWatch) -> list[WatchEvent]:
        return [e async for e in watch]

    readers = [asyncio.create_task(read(w)) for w in watches]
    await asyncio.sleep(0.05)
    await watches[0].aclose()
    assert await asyncio.wait_for(readers[0], 2) == []
    await disc.close()  # closes the other watch too
    assert await asyncio.wait_for(readers[1], 2) == []


def test_file_scans_never_reap_keys_of_leases_granted_meanwhile(tmp_path: Path) -> None:
    """A reader in another process scanning while a writer grants leases and puts keys must not
    take a fresh key for an orphan (its lease appeared after the reader listed the leases)."""
    import subprocess
    import sys

    root = tmp_path / "disc"
    stop, scanning = tmp_path / "stop", tmp_path / "scanning"
    writer = FileDiscovery(root)
    scanner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import pathlib, sys\n"
                "from kvbaton.runtime.discovery import FileDiscovery\n"
                "reader = FileDiscovery(sys.argv[1])\n"
                "reader._scan()\n"
                "pathlib.Path(sys.argv[3]).touch()\n"
                "while not pathlib.Path(sys.argv[2]).exists():\n"
                "    reader._scan()\n"
            ),
            str(root),
            str(stop),
            str(scanning),
        ]
    )

    async def put_many() -> None:
        await wait_until(scanning.exists, 30.0, "the scanner scans")
        for i in range(500):
            lease = await writer.grant_lease(30)
            await writer.put(f"/k/{i}", b"v", lease)
        if writer._keepalive_task is not None:
            writer._keepalive_task.cancel()

    try:
        asyncio.run(put_many())
    finally:
        stop.touch()
        scanner.wait(timeout=30)
    assert len(list((root / "k").iterdir())) == 500
