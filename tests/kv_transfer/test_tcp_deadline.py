"""A TCP transfer has one deadline, from start to last byte, on both sides: a peer that keeps
each socket call inside the timeout by trickling bytes cannot stretch it (a write that could
land after the deadline would land in blocks the decode worker has taken back)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from kvbaton.kv_transfer import KvPool, tcp

pytestmark = pytest.mark.unit

LAYOUT = "bfloat16:2x2x4x1x8"
BLOCKS = 8
BLOCK_BYTES = 256
TIMEOUT_S = 0.3
TRICKLE_S = 0.01  # per byte: a block takes 2.56 s, far past the deadline


@pytest.fixture
def pool() -> Iterator[KvPool]:
    pool = KvPool(shared=False)
    pool.attach(pool.allocate(BLOCKS * BLOCK_BYTES), LAYOUT, BLOCKS, BLOCK_BYTES, 2)
    assert pool.blocks is not None
    pool.blocks[:] = 0
    yield pool
    pool.close()


def _send_header(sock: socket.socket, message: msgspec.Struct) -> None:
    body = msgspec.msgpack.encode(message)
    sock.sendall(tcp.HEADER.pack(len(body)) + body)


def _recv_answer(sock: socket.socket) -> tcp.TransferAnswer:
    (size,) = tcp.HEADER.unpack(sock.recv(tcp.HEADER.size, socket.MSG_WAITALL))
    return msgspec.msgpack.decode(sock.recv(size, socket.MSG_WAITALL), type=tcp.TransferAnswer)


@pytest.mark.parametrize(
    "server_timeout_s, client_left_s",
    [(TIMEOUT_S, None), (30.0, TIMEOUT_S)],
    ids=["its-own-timeout", "the-clients-time-left"],
)
def test_the_server_stops_taking_a_trickled_write_at_its_deadline(
    pool: KvPool, server_timeout_s: float, client_left_s: float | None
) -> None:
    """The deadline is the server's own timeout, or sooner the time the client had left: a
    writer that gave up (and told the decode worker its blocks are free) lands no more bytes
    after its own timeout, whatever the server's."""
    server = tcp.KvTransferServer(pool, "127.0.0.1", server_timeout_s)
    host, _, port = server.address.rpartition(":")
    sock = socket.create_connection((host, int(port)))
    sent = 0
    request = tcp.TransferRequest(op="write", layout=LAYOUT, blocks=[5], timeout_s=client_left_s)
    try:
        _send_header(sock, request)
        assert _recv_answer(sock).ok
        with pytest.raises(OSError):  # the server closed the connection
            while sent < BLOCK_BYTES:
                sock.send(b"\xff")
                sent += 1
                time.sleep(TRICKLE_S)
    finally:
        sock.close()
        server.close()
    assert pool.blocks is not None
    landed = int((pool.blocks[5] == 0xFF).sum())
    assert 0 < landed < BLOCK_BYTES, "the write was cut at its deadline, after some bytes"
    assert not pool.blocks[5, landed:].any() and not np.delete(pool.blocks, 5, axis=0).any()


def test_the_client_gives_up_on_a_trickled_read_at_its_deadline(pool: KvPool) -> None:
    """A server that answers, then sends a block's bytes one by one, each in time."""
    listener = socket.create_server(("127.0.0.1", 0))
    sent = 0
    stop = threading.Event()

    def trickle() -> None:
        nonlocal sent
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)  # the request
            _send_header(conn, tcp.TransferAnswer(ok=True))
            while sent < BLOCK_BYTES and not stop.is_set():
                try:
                    conn.send(b"\xff")
                except OSError:
                    return
                sent += 1
                time.sleep(TRICKLE_S)

    server = threading.Thread(target=trickle)
    server.start()
    client = tcp.TcpClient(TIMEOUT_S)
    assert pool.blocks is not None
    try:
        host, port = listener.getsockname()[:2]
        with pytest.raises(TimeoutError, match=f"not done after {TIMEOUT_S:g}s"):
            client.read(f"{host}:{port}", LAYOUT, [0], pool.blocks, [2])
        assert sent < BLOCK_BYTES, "the read ended before the server had sent the block"
    finally:
        stop.set()
        server.join()
        client.close()
        listener.close()
    assert not client._idle, "a connection that timed out is not kept"


def test_a_header_sent_to_a_slow_reader_keeps_the_deadline() -> None:
    """Each send of a large message gets the time left, not the whole timeout again."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        left = socket.create_connection(listener.getsockname()[:2])
        right, _ = listener.accept()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)
    right.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    got = 0
    stop = threading.Event()

    def read_slowly() -> None:
        nonlocal got
        while not stop.is_set():
            data = right.recv(16 * 1024)
            if not data:
                return
            got += len(data)
            time.sleep(TRICKLE_S)

    reader = threading.Thread(target=read_slowly)
    reader.start()
    message = bytes(4 << 20)  # 2.5 s at 16 KB per 10 ms
    try:
        with pytest.raises(TimeoutError, match=f"not done after {TIMEOUT_S:g}s"):
            tcp._Timed(left, TIMEOUT_S, "a header").sendall(message)
        assert got < len(message)
    finally:
        stop.set()
        left.close()
        reader.join()
        right.close()


def test_a_failed_transfer_lingers_only_once_its_bytes_moved_through_the_peer(
    pool: KvPool,
) -> None:
    """After a failed transfer, its bytes may still land only where the peer's server takes
    them (a write) and only once some were sent: a refused connection or a read lingers not."""
    from kvbaton.kv_transfer import KvTransferAgent
    from kvbaton.protocols.llm import KvPoolInfo

    agent = KvTransferAgent(pool, "tcp", timeout_s=TIMEOUT_S)
    closed = socket.create_server(("127.0.0.1", 0))
    refused = closed.getsockname()[:2]
    closed.close()
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def answer_then_stall(conn: socket.socket) -> None:
        """Takes the header and answers, then neither reads nor sends (buffers fill up)."""
        with conn:
            conn.recv(4096)
            _send_header(conn, tcp.TransferAnswer(ok=True))
            stop.wait(10)

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            threading.Thread(target=answer_then_stall, args=(conn,), daemon=True).start()

    server = threading.Thread(target=serve)
    server.start()

    def peer(address: tuple[str, int]) -> KvPoolInfo:
        return KvPoolInfo(
            layout=LAYOUT,
            num_blocks=BLOCKS,
            block_bytes=BLOCK_BYTES,
            host="elsewhere",
            tcp_address=f"{address[0]}:{address[1]}",
        )

    stalling = peer(listener.getsockname()[:2])
    big = KvPool(shared=False)  # blocks too large for the socket buffers to swallow
    big.attach(big.allocate(4 * (8 << 20)), LAYOUT, 4, 8 << 20, 2)
    writer = KvTransferAgent(big, "tcp", timeout_s=TIMEOUT_S)
    try:
        with pytest.raises(ConnectionRefusedError):
            agent.write(peer(refused), [0], [0])
        assert agent.linger_s(peer(refused), "write") == 0.0
        with pytest.raises(TimeoutError):
            writer.write(msgspec.structs.replace(stalling, block_bytes=8 << 20), [0, 1], [0, 1])
        assert writer.linger_s(stalling, "write") == TIMEOUT_S
        with pytest.raises(OSError):
            agent.read(stalling, [0], [0])
        assert agent.linger_s(stalling, "read") == 0.0
    finally:
        stop.set()
        server.join()
        listener.close()
        for made in (agent, writer):
            made.close()
        big.close()
