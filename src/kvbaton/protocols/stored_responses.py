"""What a frontend asks another of the Responses API responses it keeps
(`frontend/response_store.py`): the `responses` endpoint of each frontend answers one
`StoredAnswer` to a `StoredLookup`."""

from __future__ import annotations

from typing import Any

import msgspec


class StoredResponse(msgspec.Struct, kw_only=True):
    response: dict[str, Any]  # the response object, as it was answered
    input: list[dict[str, Any]]  # its conversation's input items, earlier turns' included


class StoredLookup(msgspec.Struct, kw_only=True):
    id: str
    delete: bool = False  # and forget it


class StoredAnswer(msgspec.Struct, kw_only=True):
    stored: StoredResponse | None = None  # None: not kept there
