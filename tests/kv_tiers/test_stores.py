"""The tiers' stores on their own: a block file is accepted only whole; the disk tier writes
atomically, keeps its root within capacity by LRU, removes a dead writer's leftovers, and stops
writing (reads go on) on a full disk; the host tier is an LRU bounded in bytes."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbaton.kv_tiers import block_file
from kvbaton.kv_tiers.disk import DiskTier
from kvbaton.kv_tiers.host import HostTier

pytestmark = pytest.mark.unit

KEY = bytes(range(16))
KV = bytes(range(256)) * 4  # a 1 KiB block


def stored(h: int, kv: bytes = KV, key: bytes = KEY) -> bytes:
    return block_file.encode_header(key, h, kv) + kv


def test_a_block_file_is_accepted_only_whole_and_as_expected() -> None:
    data = stored(7)
    assert block_file.decode(data, KEY, 7, len(KV)) == KV
    flipped = bytearray(data)
    flipped[-1] ^= 1
    for bad, key, h in [
        (data[:-1], KEY, 7),  # truncated
        (bytes(flipped), KEY, 7),  # a flipped bit
        (data, KEY, 8),  # another block's
        (data, bytes(16), 7),  # another store's
        (data[: block_file.HEADER_BYTES], KEY, 7),  # a header alone
    ]:
        assert block_file.decode(bad, key, h, len(KV)) is None


def test_disk_tier_round_trip_and_shared_root(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, KEY, len(KV), 2**20)
    assert not disk.contains(1) and disk.read(1) is None
    assert disk.write(1, KV)
    other = DiskTier(tmp_path, KEY, len(KV), 2**20)  # another process of the host
    assert other.contains(1) and other.read(1) == KV
    assert not DiskTier(tmp_path, bytes(16), len(KV), 2**20).contains(1)  # another store
    assert not list((tmp_path / "tmp").iterdir())  # nothing left half written


def test_disk_tier_keeps_its_root_within_capacity_least_recently_used_first(
    tmp_path: Path,
) -> None:
    file_bytes = block_file.HEADER_BYTES + len(KV)
    disk = DiskTier(tmp_path, KEY, len(KV), 10 * file_bytes)
    for h in range(10):
        assert disk.write(h, KV)
        os.utime(disk.path(h), (h, h))  # written a second apart, oldest first
    assert disk.read(0) == KV  # used now: the newest
    assert disk.write(10, KV)  # over capacity: down to nine tenths
    kept = {h for h in range(11) if disk.contains(h)}
    assert kept == {0, *range(3, 11)}
    assert (disk.num_files, disk.num_bytes, disk.removed) == (9, 9 * file_bytes, 2)


def test_a_full_disk_stops_writes_not_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = DiskTier(tmp_path, KEY, len(KV), 2**20)
    assert disk.write(1, KV)
    calls = []

    def full(src: object, dst: object) -> None:
        calls.append(dst)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    assert not disk.write(2, KV)
    assert not disk.writable
    assert not disk.write(3, KV) and len(calls) == 1  # no further attempt
    assert disk.read(1) == KV
    assert not list((tmp_path / "tmp").iterdir())


def test_a_capacity_below_one_block_takes_nothing(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, KEY, len(KV), len(KV))
    assert not disk.writable and not disk.write(1, KV) and not disk.contains(1)


def test_a_dead_writers_temporary_files_are_removed(tmp_path: Path) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    (tmp_path / "tmp").mkdir()
    orphan = tmp_path / "tmp" / f"{gone.stdout.strip()}-0.tmp"
    orphan.write_bytes(stored(1)[:100])
    live = tmp_path / "tmp" / f"{os.getppid()}-0.tmp"  # its writer runs: left alone
    live.write_bytes(b"")
    DiskTier(tmp_path, KEY, len(KV), 2**20)
    assert not orphan.exists() and live.exists()


def test_host_tier_is_lru_within_its_bytes() -> None:
    host = HostTier(3 * len(KV))
    for h in range(3):
        host.put(h, KV)
    assert host.get(0) == KV  # the newest now
    host.put(3, KV)
    assert [h for h in range(4) if h in host] == [0, 2, 3]
    assert (host.num_blocks, host.num_bytes) == (3, 3 * len(KV))
    host.put(9, bytes(4 * len(KV)))  # larger than all of it: not kept
    assert 9 not in host and host.num_blocks == 3
