"""uvicorn embedded in a kvbaton process (the frontend's OpenAI API, the http request plane):
on a socket bound here, with the process's own signal handling."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Generator

import uvicorn


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket for uvicorn (port 0: a free one), TCP_NODELAY for every accepted
    connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.setblocking(False)
    return sock


class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside a process that handles its own signals (and stops it itself)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield
