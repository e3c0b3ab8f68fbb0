"""Request planes: how a request and its stream of responses travel between processes."""

from kvbaton.runtime.request_plane.tcp_client import Stream, TcpRequestClient
from kvbaton.runtime.request_plane.tcp_server import Handler, TcpRequestServer

__all__ = ["Handler", "Stream", "TcpRequestClient", "TcpRequestServer"]
