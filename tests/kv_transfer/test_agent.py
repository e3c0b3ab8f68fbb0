"""The transfer agent over shared memory and TCP, between this process and a peer process that
owns a pool: reads and writes land byte-exact (runs and scattered blocks, whole or some layers of
each), `auto` picks shm on one host, and every bad request fails clearly without touching a
pool."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from multiprocessing.connection import Connection

import msgspec
import numpy as np
import pytest

from kvbaton.kv_transfer import KvPool, KvTransferAgent
from kvbaton.protocols.llm import KvPoolInfo

pytestmark = pytest.mark.unit

LAYOUT = "bfloat16:2x2x4x1x8"
BLOCKS = 32
BLOCK_BYTES = 2 * 2 * 4 * 1 * 8 * 2  # 256
LAYERS = 2


def make_pool(shared: bool, seed: int) -> KvPool:
    pool = KvPool(shared=shared)
    buffer = pool.allocate(BLOCKS * BLOCK_BYTES)
    pool.attach(buffer, LAYOUT, BLOCKS, BLOCK_BYTES, LAYERS)
    assert pool.blocks is not None
    pool.blocks[:] = np.random.default_rng(seed).integers(0, 256, pool.blocks.shape, np.uint8)
    return pool


def serve_peer(conn: Connection) -> None:
    """The peer: a pool in shared memory, served over TCP; answers with its info, then its
    blocks' bytes on request, until told to stop."""
    pool = make_pool(shared=True, seed=1)
    agent = KvTransferAgent(pool, "tcp")
    agent.start("127.0.0.1")
    conn.send_bytes(msgspec.msgpack.encode(agent.info()))
    while conn.recv() == "blocks":
        assert pool.blocks is not None
        conn.send_bytes(pool.blocks.tobytes())
    agent.close()
    pool.close()


class Peer:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve_peer, args=(child,), daemon=True)
        self.proc.start()
        self.info = msgspec.msgpack.decode(self.conn.recv_bytes(), type=KvPoolInfo)

    def blocks(self) -> np.ndarray:
        self.conn.send("blocks")
        return np.frombuffer(self.conn.recv_bytes(), np.uint8).reshape(BLOCKS, BLOCK_BYTES)

    def stop(self) -> None:
        self.conn.send("stop")
        self.proc.join(10)


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    peer = Peer()
    yield peer
    peer.stop()


@pytest.fixture
def local() -> Iterator[KvTransferAgent]:
    agent = KvTransferAgent(make_pool(shared=False, seed=2), "auto")
    yield agent
    agent.close()
    agent.pool.close()


SRC = [3, 4, 5, 9, 0, 31]  # a run, then scattered
DST = [10, 11, 12, 1, 30, 2]


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_reads_and_writes_land_byte_exact(peer: Peer, backend: str) -> None:
    agent = KvTransferAgent(make_pool(shared=False, seed=3), backend)
    try:
        ours = agent.pool.blocks
        assert ours is not None
        before = ours.copy()
        theirs = peer.blocks()
        assert agent.read(peer.info, SRC, DST) == backend
        assert np.array_equal(ours[DST], theirs[SRC])
        untouched = [b for b in range(BLOCKS) if b not in DST]
        assert np.array_equal(ours[untouched], before[untouched])

        ours[[7, 8]] = 0xAB
        assert agent.write(peer.info, [7, 8], [20, 6]) == backend
        after = peer.blocks()
        assert (after[[20, 6]] == 0xAB).all()
        others = [b for b in range(BLOCKS) if b not in (20, 6)]
        assert np.array_equal(after[others], theirs[others])
        assert agent.read(peer.info, [], []) == backend  # nothing to move
    finally:
        agent.close()
        agent.pool.close()


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_some_layers_of_each_block_land_byte_exact_and_nothing_else(
    peer: Peer, backend: str
) -> None:
    """Layer 1 of scattered blocks (each block's second half), read and written: those bytes
    move, the rest of every block stays."""
    agent = KvTransferAgent(make_pool(shared=False, seed=7), backend)
    half = BLOCK_BYTES // LAYERS
    try:
        ours = agent.pool.blocks
        assert ours is not None
        before = ours.copy()
        theirs = peer.blocks()
        assert agent.read(peer.info, SRC, DST, layers=(1, 2)) == backend
        expected = before.copy()
        expected[DST, half:] = theirs[SRC, half:]
        assert np.array_equal(ours, expected)

        ours[[7, 8]] = 0xCD
        agent.write(peer.info, [7, 8], [20, 6], layers=(0, 1))
        after = peer.blocks()
        changed = theirs.copy()
        changed[[20, 6], :half] = 0xCD
        assert np.array_equal(after, changed)
        agent.write(peer.info, [7], [20], layers=(0, 2))  # both layers: the whole block
        assert (peer.blocks()[20] == 0xCD).all()
        for bad in [(1, 1), (0, 3), (-1, 1)]:
            with pytest.raises(ValueError, match="layers must be a range"):
                agent.read(peer.info, [0], [0], layers=bad)
    finally:
        agent.close()
        agent.pool.close()


def test_the_tcp_server_refuses_a_part_outside_a_block(peer: Peer, local: KvTransferAgent) -> None:
    from kvbaton.kv_transfer import tcp

    client = tcp.TcpClient(5.0)
    blocks = local.pool.blocks
    assert blocks is not None
    try:
        with pytest.raises(RuntimeError, match="not within a block"):
            client.read(peer.info.tcp_address, LAYOUT, [0], blocks, [0], slice(200, 300))
    finally:
        client.close()


def test_auto_picks_shm_on_one_host_and_tcp_otherwise(peer: Peer, local: KvTransferAgent) -> None:
    assert local.choose(peer.info) == "shm"
    elsewhere = msgspec.structs.replace(peer.info, host="another-host")
    assert local.choose(elsewhere) == "tcp"
    forced = KvTransferAgent(local.pool, "shm")
    with pytest.raises(ValueError, match="on this host"):
        forced.choose(elsewhere)


def test_bad_transfers_fail_clearly(peer: Peer, local: KvTransferAgent) -> None:
    with pytest.raises(ValueError, match="layout"):
        local.read(msgspec.structs.replace(peer.info, layout="float32:1x2x4x1x8"), [0], [0])
    with pytest.raises(ValueError, match="as many"):
        local.read(peer.info, [0, 1], [0])
    with pytest.raises(ValueError, match="block ids"):
        local.read(peer.info, [0], [BLOCKS])
    with pytest.raises(ValueError, match="peer's block ids"):
        local.read(peer.info, [BLOCKS], [0])
    tcp = KvTransferAgent(local.pool, "tcp")
    with pytest.raises(ValueError, match="serves no KV over TCP"):
        tcp.read(msgspec.structs.replace(peer.info, tcp_address=""), [0], [0])


def test_the_tcp_server_checks_what_the_client_cannot(peer: Peer, local: KvTransferAgent) -> None:
    """A peer whose info lies (more blocks than it has): its server refuses, the client says
    so, and the connection closes without harm."""
    liar = msgspec.structs.replace(peer.info, num_blocks=BLOCKS * 2)
    tcp = KvTransferAgent(local.pool, "tcp")
    with pytest.raises(RuntimeError, match="refused: block ids must be in"):
        tcp.read(liar, [BLOCKS + 1], [0])
    assert tcp.read(peer.info, [1], [1]) == "tcp"  # the server serves on


def test_a_pool_in_shared_memory_is_unlinked_on_close() -> None:
    pool = make_pool(shared=True, seed=4)
    name = pool.info().shm_name
    assert name and os.path.exists(f"/dev/shm/{name}")
    pool.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_a_mocker_pool_moves_nothing() -> None:
    pool = KvPool(shared=True)
    pool.attach(None, "MockerRunner", 64, 0)
    agent = KvTransferAgent(pool, "auto")
    agent.start("127.0.0.1")
    info = agent.info()
    assert info.block_bytes == 0 and not info.shm_name and not info.tcp_address
    assert agent.read(info, [1, 2], [3, 4]) == "none"
    agent.close()


def test_tcp_keeps_its_connection_and_replaces_a_broken_one(peer: Peer) -> None:
    import socket

    agent = KvTransferAgent(make_pool(shared=False, seed=5), "tcp")
    try:
        agent.read(peer.info, [1], [1])
        agent.read(peer.info, [2], [2])
        (kept,) = agent._tcp._idle[peer.info.tcp_address]  # one connection served both
        kept.shutdown(socket.SHUT_RDWR)  # as when the server closed an idle one
        agent.read(peer.info, SRC, DST)
        assert agent.pool.blocks is not None
        assert np.array_equal(agent.pool.blocks[DST], peer.blocks()[SRC])
        (fresh,) = agent._tcp._idle[peer.info.tcp_address]
        assert fresh is not kept
    finally:
        agent.close()
        agent.pool.close()


def test_vectored_sends_and_receives_split_and_resume_anywhere() -> None:
    """Runs larger than a call's chunk, more pieces than a call takes, partial sends and
    receives (a small socket buffer): every byte lands where it belongs."""
    import socket
    import threading

    from kvbaton.kv_transfer import tcp

    rng = np.random.default_rng(6)
    source = rng.integers(0, 256, (40, 300_000), np.uint8)
    target = np.zeros_like(source)
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 20, 22, 39, 30, 31, 32]
    dst = [39 - i for i in range(len(ids))]
    left, right = socket.socketpair()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    sending = tcp._Timed(left, 30.0, "send")
    sender = threading.Thread(target=tcp._send_blocks, args=(sending, source, ids, tcp.WHOLE))
    sender.start()
    tcp._recv_blocks(tcp._Timed(right, 30.0, "receive"), target, dst, tcp.WHOLE)
    sender.join()
    left.close()
    right.close()
    assert np.array_equal(target[dst], source[ids])
    assert not target[[b for b in range(40) if b not in dst]].any()


def test_a_tcp_peer_that_never_answers_times_out(local: KvTransferAgent) -> None:
    import socket
    import time

    silent = socket.create_server(("127.0.0.1", 0))  # listens, never answers
    try:
        host, port = silent.getsockname()[:2]
        peer = KvPoolInfo(
            layout=LAYOUT,
            num_blocks=BLOCKS,
            block_bytes=BLOCK_BYTES,
            host="elsewhere",
            tcp_address=f"{host}:{port}",
        )
        agent = KvTransferAgent(local.pool, "tcp", timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(OSError):
            agent.read(peer, [0], [0])
        assert time.monotonic() - started < 5
        agent.close()
    finally:
        silent.close()
