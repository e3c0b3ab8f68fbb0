"""Wire types, one place: every struct that crosses a process boundary.

All are msgspec Structs. Frames of the request plane are msgpack arrays (compact, tagged);
discovery records are JSON objects (readable with `cat` or `etcdctl get`). Unknown fields are
ignored on decode, so a newer peer can add fields without breaking an older one.
"""

from kvbaton.protocols.discovery import Instance
from kvbaton.protocols.frames import Cancel, Credit, Data, End, Error, ErrorKind, Frame, Request

__all__ = ["Cancel", "Credit", "Data", "End", "Error", "ErrorKind", "Frame", "Instance", "Request"]
