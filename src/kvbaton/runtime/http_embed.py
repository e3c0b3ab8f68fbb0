"""uvicorn embedded in a kvbaton process (the frontend's OpenAI API, the http request plane):
on a socket bound here, with the process's own signal handling."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Generator

import uvicorn


def listen(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket for uvicorn (port 0: a free one), TCP_NODELAY for every accepted
    connection. `reuse_port`: several processes listen on the port, and the kernel spreads the
    connections over those listening (SO_REUSEPORT; processes of the same user only)."""
    sock = bound(host, port, reuse_port=reuse_port)
    try:
        start_listening(sock)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


def start_listening(sock: socket.socket) -> None:
    """A bound socket, listening, for uvicorn (TCP_NODELAY for every accepted connection)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it
    sock.listen(2048)
    sock.setblocking(False)


def bound(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: a free one), not listening. With `reuse_port`,
    held open it keeps the port for the processes that then listen on it with `reuse_port`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside a process that handles its own signals (and stops it itself)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield
