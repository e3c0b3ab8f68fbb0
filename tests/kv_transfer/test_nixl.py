"""The NIXL backend moves KV blocks between two processes byte for byte (READ and WRITE, runs
and scattered ids, some layers of each block, concurrent transfers), `auto` picks it when both
agents have NIXL, and a bad peer, a dead one or a stalled one raises clearly. Runs on the CPU:
UCX moves host memory."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import pytest

from kvbaton.kv_transfer import KvPool, KvTransferAgent
from kvbaton.protocols.llm import KvPoolInfo

try:
    from kvbaton.kv_transfer.nixl import NixlBackend
except ImportError as exc:  # the test extra installs it on Linux
    pytest.skip(f"NIXL is not installed ({exc})", allow_module_level=True)

pytestmark = pytest.mark.integration

NUM_BLOCKS = 64
BLOCK_BYTES = 12 * 1024
LAYOUT = "test:uint8[12288]"
LAYERS = 4  # of 3 KB
PEER_SEED, LOCAL_SEED = 7, 11


def pool_bytes(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (NUM_BLOCKS, BLOCK_BYTES), dtype=np.uint8)


def make_pool(seed: int) -> KvPool:
    pool = KvPool(shared=False)
    pool.attach(pool.allocate(NUM_BLOCKS * BLOCK_BYTES), LAYOUT, NUM_BLOCKS, BLOCK_BYTES, LAYERS)
    assert pool.blocks is not None
    pool.blocks[:] = pool_bytes(seed)
    return pool


def blocks_of(agent: KvTransferAgent) -> np.ndarray:
    assert agent.pool.blocks is not None
    return agent.pool.blocks


def serve_peer(conn: Connection, backend: str, seed: int) -> None:
    """The other process: a pool of random bytes behind an agent, until told to stop."""
    pool = make_pool(seed)
    agent = KvTransferAgent(pool, backend)
    agent.start("127.0.0.1", "peer")
    conn.send_bytes(msgspec.msgpack.encode(agent.info()))
    assert pool.blocks is not None
    while True:
        command = conn.recv()
        if command == "blocks":
            conn.send_bytes(pool.blocks.tobytes())
        elif command == "reset":
            pool.blocks[:] = pool_bytes(seed)
            conn.send_bytes(b"")
        else:
            break
    agent.close()
    pool.close()


@dataclass
class Peer:
    process: Any
    conn: Connection
    info: KvPoolInfo

    def blocks(self) -> np.ndarray:
        self.conn.send("blocks")
        data = self.conn.recv_bytes()
        return np.frombuffer(data, dtype=np.uint8).reshape(NUM_BLOCKS, BLOCK_BYTES)

    def reset(self) -> None:
        self.conn.send("reset")
        self.conn.recv_bytes()

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                os.kill(self.process.pid, signal.SIGCONT)
                self.conn.send("stop")
            except (OSError, BrokenPipeError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self.conn.close()


def start_peer(backend: str = "auto", seed: int = PEER_SEED) -> Peer:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=serve_peer, args=(theirs, backend, seed), daemon=True)
    process.start()
    theirs.close()
    if not ours.poll(60):
        process.kill()
        raise RuntimeError("the peer process did not start")
    info = msgspec.msgpack.decode(ours.recv_bytes(), type=KvPoolInfo)
    return Peer(process, ours, info)


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    """A peer process serving with `auto` (NIXL and TCP); tests that write reset it."""
    started = start_peer()
    yield started
    started.stop()


@pytest.fixture
def local() -> Iterator[KvTransferAgent]:
    pool = make_pool(LOCAL_SEED)
    agent = KvTransferAgent(pool, "nixl")
    agent.start("127.0.0.1", "local")
    yield agent
    agent.close()
    pool.close()


# Runs of consecutive ids in both lists, ids out of order, both ends of the pool.
SRC = [5, 6, 7, 8, 40, 2, 3, 63, 0, 20, 22, 24]
DST = [10, 11, 12, 13, 1, 50, 51, 0, 63, 30, 31, 32]


def test_nixl_reads_a_peers_blocks(peer: Peer, local: KvTransferAgent) -> None:
    assert peer.info.nixl_metadata, "the peer has NIXL"
    theirs, before = pool_bytes(PEER_SEED), blocks_of(local).copy()
    assert local.read(peer.info, SRC, DST) == "nixl"
    expected = before.copy()
    expected[DST] = theirs[SRC]
    np.testing.assert_array_equal(blocks_of(local), expected)
    assert local.counts().bytes_moved == len(SRC) * BLOCK_BYTES
    # Again (the peer is added once and kept), and a single block.
    assert local.read(peer.info, [9], [9]) == "nixl"
    np.testing.assert_array_equal(blocks_of(local)[9], theirs[9])


def test_nixl_writes_into_a_peers_blocks(peer: Peer, local: KvTransferAgent) -> None:
    ours = blocks_of(local).copy()
    try:
        assert local.write(peer.info, SRC, DST) == "nixl"
        expected = pool_bytes(PEER_SEED)
        expected[DST] = ours[SRC]
        np.testing.assert_array_equal(peer.blocks(), expected)
        np.testing.assert_array_equal(blocks_of(local), ours)  # a write leaves ours alone
    finally:
        peer.reset()


def test_nixl_moves_some_layers_of_each_block(peer: Peer, local: KvTransferAgent) -> None:
    """Layers 1 and 2 of scattered blocks (the middle half of each), read then written."""
    part = slice(BLOCK_BYTES // LAYERS, 3 * BLOCK_BYTES // LAYERS)
    theirs, ours = pool_bytes(PEER_SEED), blocks_of(local).copy()
    try:
        assert local.read(peer.info, SRC, DST, layers=(1, 3)) == "nixl"
        expected = ours.copy()
        expected[DST, part] = theirs[SRC, part]
        np.testing.assert_array_equal(blocks_of(local), expected)
        assert local.counts().bytes_moved == len(SRC) * BLOCK_BYTES // 2

        assert local.write(peer.info, [0, 1], [40, 9], layers=(1, 3)) == "nixl"
        expected = theirs.copy()
        expected[[40, 9], part] = blocks_of(local)[[0, 1], part]
        np.testing.assert_array_equal(peer.blocks(), expected)
    finally:
        peer.reset()


def test_an_empty_transfer_moves_nothing(peer: Peer, local: KvTransferAgent) -> None:
    before = blocks_of(local).copy()
    assert local.read(peer.info, [], []) == "nixl"
    assert local.write(peer.info, [], []) == "nixl"
    np.testing.assert_array_equal(blocks_of(local), before)
    assert local.counts().bytes_moved == 0


def test_concurrent_reads_on_one_backend(peer: Peer, local: KvTransferAgent) -> None:
    """A decode worker runs several loads at once on one agent."""
    theirs = pool_bytes(PEER_SEED)
    order = np.random.default_rng(3).permutation(NUM_BLOCKS)
    slices = [order[i::4] for i in range(4)]  # four disjoint sets of destination blocks
    errors: list[BaseException] = []

    def load(dst: np.ndarray, rounds: int) -> None:
        try:
            for r in range(rounds):
                src = [(int(d) + r) % NUM_BLOCKS for d in dst]
                local.read(peer.info, src, [int(d) for d in dst])
                np.testing.assert_array_equal(blocks_of(local)[dst], theirs[src])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(dst, 20)) for dst in slices]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors


def test_auto_picks_nixl_when_both_sides_have_it(peer: Peer) -> None:
    pool = make_pool(LOCAL_SEED)
    agent = KvTransferAgent(pool, "auto")
    agent.start("127.0.0.1", "local-auto")
    try:
        assert agent.info().nixl_metadata and agent.info().tcp_address
        assert agent.choose(peer.info) == "nixl"
        assert agent.read(peer.info, SRC, DST) == "nixl"
        np.testing.assert_array_equal(blocks_of(agent)[DST], pool_bytes(PEER_SEED)[SRC])
        # A peer without NIXL: auto falls back (its pool is not shared, so TCP).
        without = msgspec.structs.replace(peer.info, nixl_metadata=b"")
        assert agent.choose(without) == "tcp"
        assert agent.read(without, [1], [2]) == "tcp"
    finally:
        agent.close()
        pool.close()


def test_bad_nixl_metadata_raises(peer: Peer, local: KvTransferAgent) -> None:
    with pytest.raises(ValueError, match="nixl needs NIXL on both workers"):
        local.read(msgspec.structs.replace(peer.info, nixl_metadata=b""), [1], [1])
    with pytest.raises(ValueError, match="unreadable"):
        local.read(msgspec.structs.replace(peer.info, nixl_metadata=b"garbage"), [1], [1])
    # Well-formed, but the NIXL agent metadata inside is not.
    published = msgspec.msgpack.decode(peer.info.nixl_metadata)
    published["agent"] = b"not a nixl agent"
    published["name"] = "someone-else"
    broken = msgspec.structs.replace(peer.info, nixl_metadata=msgspec.msgpack.encode(published))
    with pytest.raises(ValueError, match="NIXL cannot add peer someone-else"):
        local.read(broken, [1], [1])
    assert local.linger_s(peer.info, "read") == 0.0  # it failed before any byte could move
    # Our own metadata is no peer.
    with pytest.raises(ValueError, match="this NIXL agent"):
        local.read(local.info(), [1], [2])
    # The good peer still works.
    assert local.read(peer.info, [1], [1]) == "nixl"


def test_a_stalled_peer_times_out_and_a_dead_one_fails() -> None:
    """A stopped peer cannot answer NIXL's first connection: the read times out and its handle
    is released; once the peer runs again the next read works; once it is dead, reads fail."""
    other = start_peer("nixl", seed=PEER_SEED + 1)
    pool = make_pool(LOCAL_SEED)
    agent = KvTransferAgent(pool, "nixl", timeout_s=1.0)
    agent.start("127.0.0.1", "local-timeout")
    try:
        os.kill(other.process.pid, signal.SIGSTOP)
        with pytest.raises(TimeoutError, match="not done after 1s"):
            agent.read(other.info, [1, 2, 3], [1, 2, 3])
        assert agent.linger_s(other.info, "read") == 2.0  # posted: NIXL may still finish it
        # Eight at once: one poller checks them all, not a thread each.
        assert agent._nixl is not None
        nixl_agent = agent._nixl._agent
        checked_by: set[str] = set()
        check = nixl_agent.check_xfer_state

        def recorded(handle: object) -> str:
            checked_by.add(threading.current_thread().name)
            return str(check(handle))

        nixl_agent.check_xfer_state = recorded
        timeouts: list[BaseException] = []

        together = threading.Barrier(8)  # (each posts before any times out)

        def read(block: int) -> None:
            together.wait(10)
            try:
                agent.read(other.info, [block], [block])
            except TimeoutError as exc:
                timeouts.append(exc)

        readers = [threading.Thread(target=read, args=(b,)) for b in range(8)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(10)
        nixl_agent.check_xfer_state = check
        assert len(timeouts) == 8
        assert checked_by == {f"nixl-poller-{agent._nixl.name}"}
        os.kill(other.process.pid, signal.SIGCONT)
        assert agent.read(other.info, [1, 2, 3], [1, 2, 3]) == "nixl"
        np.testing.assert_array_equal(blocks_of(agent)[1:4], pool_bytes(PEER_SEED + 1)[1:4])
        other.process.kill()
        other.process.join(10)
        with pytest.raises(ConnectionError, match="NIXL"):
            agent.read(other.info, [4], [4])
        with pytest.raises(ConnectionError, match="NIXL"):
            agent.write(other.info, [4], [4])
    finally:
        other.stop()
        agent.close()
        pool.close()


def test_two_backends_in_one_process() -> None:
    """The backend itself: unique agent names, its metadata, its checks, and close."""
    a, b = make_pool(1), make_pool(2)
    first, second = NixlBackend(a, "same"), NixlBackend(b, "same")
    try:
        assert first.name != second.name
        assert first.metadata() == first.metadata()
        info_b = b.info(nixl_metadata=second.metadata())
        first.read(info_b, [0, 1, 2, 9], [3, 4, 5, 6], 10.0)
        assert a.blocks is not None and b.blocks is not None
        np.testing.assert_array_equal(a.blocks[[3, 4, 5, 6]], b.blocks[[0, 1, 2, 9]])
        first.write(info_b, [10, 11], [62, 63], 10.0)
        np.testing.assert_array_equal(b.blocks[[62, 63]], a.blocks[[10, 11]])
        with pytest.raises(ValueError, match="block ids"):
            first.read(info_b, [0], [NUM_BLOCKS], 10.0)
        with pytest.raises(ValueError, match="peer's block ids"):
            first.write(info_b, [0], [-1], 10.0)
        with pytest.raises(ValueError, match="as many"):
            first.read(info_b, [0, 1], [0], 10.0)
        with pytest.raises(ValueError, match="host memory"):
            NixlBackend(KvPool(shared=False), "empty")
    finally:
        first.close()
        second.close()
        first.close()  # twice is fine
        a.close()
        b.close()
    with pytest.raises(RuntimeError, match="closed"):
        first.read(info_b, [0], [0], 10.0)


def test_a_failed_peer_goes_once_its_other_transfers_ended() -> None:
    """A transfer with a peer failed while another one with it is under way: the peer is
    dropped only after that one ended (dropping it at once would make NIXL end the other and
    free its handle); a transfer meanwhile fails at once; then the peer is added anew."""
    other = start_peer("nixl", seed=PEER_SEED + 2)
    pool = make_pool(LOCAL_SEED)
    backend = NixlBackend(pool, "local-failing")
    try:
        os.kill(other.process.pid, signal.SIGSTOP)
        slow: list[BaseException] = []

        def read_slowly() -> None:
            try:
                backend.read(other.info, [4], [4], 2.0)
            except BaseException as exc:
                slow.append(exc)

        reader = threading.Thread(target=read_slowly)
        reader.start()
        for _ in range(100):  # until the slow read is under way
            if sum(backend._busy.values()) == 1:
                break
            time.sleep(0.05)
        with pytest.raises(TimeoutError):
            backend.read(other.info, [1], [1], 0.5)
        with pytest.raises(ConnectionError, match="being reset"):
            backend.read(other.info, [2], [2], 5.0)
        reader.join(10)
        assert len(slow) == 1 and isinstance(slow[0], TimeoutError), slow
        os.kill(other.process.pid, signal.SIGCONT)
        backend.read(other.info, [3], [3], 10.0)
        assert pool.blocks is not None
        np.testing.assert_array_equal(pool.blocks[3], pool_bytes(PEER_SEED + 2)[3])
    finally:
        other.stop()
        backend.close()
        pool.close()


def test_a_backend_let_go_without_close_is_collected() -> None:
    """Its threads hold it only weakly: they end once it is gone."""
    import gc
    import weakref

    pool = make_pool(LOCAL_SEED)
    backend = NixlBackend(pool, "local-dropped")
    threads = [backend._poller._thread, backend._progress]
    gone = weakref.ref(backend)
    del backend
    for _ in range(50):  # (a thread may hold it for a moment)
        gc.collect()
        if gone() is None:
            break
        time.sleep(0.1)
    assert gone() is None
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()
    pool.close()
