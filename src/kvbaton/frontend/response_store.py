"""The responses of OpenAI's Responses API that frontends keep (`store`, true by default as in
OpenAI's API): what `previous_response_id`, `GET` and `DELETE /v1/responses/{id}` and
`GET /v1/responses/{id}/input_items` read.

- Each frontend keeps the responses it answered, in memory, as JSON: at most `max_bytes` of
  it, the least recently used forgotten first (one larger than that is not kept). A restart
  forgets them all.
- A response keeps its whole conversation (earlier turns' items too): a turn reads one
  response, never a chain, and any response can be forgotten without breaking later ones.
- A response's id names the frontend that keeps it (`resp_{frontend instance:x}_{random}`):
  another frontend of the namespace (a replica on the same port, say) asks that one for it, on
  its `{namespace}.frontend.responses` endpoint, within `LOOKUP_TIMEOUT_S`.
- An id not kept (forgotten, deleted, its frontend gone, or not an id of this form) is not
  found: the caller's 404. Its frontend there but not answering in time is a 503
  (`OpenAIError`), which a client may retry.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections import OrderedDict
from typing import Any

import msgspec

from kvbaton.frontend.errors import OpenAIError, response_not_found
from kvbaton.protocols.stored_responses import StoredAnswer, StoredLookup, StoredResponse
from kvbaton.runtime import Client, Context, DistributedRuntime, NoInstancesError

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 5.0  # for another frontend's answer
DEFAULT_MAX_BYTES = 64 << 20


class ResponseStore:
    """The responses one frontend keeps, least recently used forgotten past `max_bytes`."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._kept: OrderedDict[str, bytes] = OrderedDict()  # as JSON: its size is its cost

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Keep `stored` (False: larger than the store, not kept)."""
        kept = _encode(stored)
        self.delete(response_id)
        if len(kept) > self.max_bytes:
            return False
        self._kept[response_id] = kept
        self.bytes += len(kept)
        while self.bytes > self.max_bytes:
            _, forgotten = self._kept.popitem(last=False)
            self.bytes -= len(forgotten)
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        kept = self._kept.get(response_id)
        if kept is None:
            return None
        self._kept.move_to_end(response_id)
        return _decode(kept)

    def delete(self, response_id: str) -> StoredResponse | None:
        kept = self._kept.pop(response_id, None)
        if kept is None:
            return None
        self.bytes -= len(kept)
        return _decode(kept)


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(StoredResponse).decode
_ID = re.compile(r"^resp_([0-9a-f]{1,16})_[0-9a-f]+$")


def keeper(response_id: str) -> int | None:
    """The frontend instance an id names (None: not an id of this form)."""
    match = _ID.match(response_id)
    return int(match.group(1), 16) if match else None


class StoredResponses:
    """This frontend's kept responses, and the way to the other frontends' (see the module's
    docstring). Without a runtime (tests of the app alone), this frontend's only."""

    def __init__(
        self,
        runtime: DistributedRuntime | None = None,
        namespace: str = "kvbaton",
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.runtime = runtime
        self.endpoint = f"{namespace}.frontend.responses"
        self.local = ResponseStore(max_bytes)
        self._me = 0  # this frontend's instance id, once `start` knows it
        self._client: Client | None = None

    @property
    def enabled(self) -> bool:
        return self.local.max_bytes > 0

    def new_id(self) -> str:
        return f"resp_{self._me:x}_{uuid.uuid4().hex}"

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if not self.local.put(response_id, stored):
            log.info("response %s not kept: larger than the store", response_id)

    async def get(self, response_id: str, param: str) -> StoredResponse:
        """The kept response (an OpenAIError naming `param`, 404 if not kept)."""
        return await self._found(StoredLookup(id=response_id), param)

    async def delete(self, response_id: str, param: str) -> StoredResponse:
        """The same, forgotten."""
        return await self._found(StoredLookup(id=response_id, delete=True), param)

    async def _found(self, lookup: StoredLookup, param: str) -> StoredResponse:
        found = await self._find(lookup)
        if found is None:
            raise response_not_found(lookup.id, param)
        return found

    async def _find(self, lookup: StoredLookup) -> StoredResponse | None:
        found = self._answer(lookup).stored
        owner = keeper(lookup.id)
        if found is not None or owner is None or owner == self._me or self._client is None:
            return found
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT_S):
                async for answer in self._client.direct(lookup, owner):
                    return answer.stored  # type: ignore[no-any-return]
        except NoInstancesError:  # its frontend is gone, and its responses with it
            return None
        except Exception as exc:
            log.warning("response %s: frontend %x did not answer: %r", lookup.id, owner, exc)
            raise OpenAIError(
                503,
                f"the frontend that keeps response {lookup.id} did not answer; try again",
                code="keeper_unavailable",
                headers={"retry-after": "1"},
            ) from None
        return None

    def _answer(self, lookup: StoredLookup) -> StoredAnswer:
        if lookup.delete:
            return StoredAnswer(stored=self.local.delete(lookup.id))
        return StoredAnswer(stored=self.local.get(lookup.id))

    async def _serve(self, lookup: StoredLookup, context: Context) -> StoredAnswer:
        """The `responses` handler: another frontend's lookup."""
        return self._answer(lookup)

    async def start(self) -> None:
        """Learn this frontend's instance id (which new ids name) and reach the others."""
        if self.runtime is not None and self._client is None:
            self._me = await self.runtime.ensure_instance_id()
            endpoint = self.runtime.endpoint(self.endpoint)
            self._client = await endpoint.client(response_type=StoredAnswer)

    async def run(self) -> None:
        """Serve this frontend's responses to the others until cancelled (after `start`)."""
        if self.runtime is None:
            return
        try:
            await self.runtime.endpoint(self.endpoint).serve_endpoint(
                self._serve, request_type=StoredLookup
            )
        finally:
            if self._client is not None:
                client, self._client = self._client, None
                await client.close()


def input_page(
    items: list[dict[str, Any]], limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """A page of `items` (oldest first as kept) as OpenAI's list: `order` "asc" or "desc", from
    the item after `after` (an item id), at most `limit` of them."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise KeyError(after)
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }
