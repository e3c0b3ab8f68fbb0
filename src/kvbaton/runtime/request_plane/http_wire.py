"""What both sides of the HTTP request plane agree on: the path and the content type (and the
server's wording of the frame limit). The plane itself: http_server.py and http_client.py."""

from __future__ import annotations

PATH = "/rpc"
CONTENT_TYPE = b"application/x-kvbaton-frames"


def too_big(size: int, limit: int) -> str:
    return f"a frame of {size} bytes is over the limit of {limit} bytes"
