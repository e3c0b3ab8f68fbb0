"""The Responses API's kept responses (`frontend/response_store.py`): bounded by bytes, the
least recently used forgotten first; ids that name their frontend; pages of input items."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from kvbaton.frontend import response_store
from kvbaton.frontend.errors import OpenAIError
from kvbaton.frontend.response_store import ResponseStore, StoredResponses, input_page, keeper
from kvbaton.protocols.stored_responses import StoredResponse
from kvbaton.runtime import NoInstancesError


def kept(text: str) -> StoredResponse:
    return StoredResponse(response={"id": text, "output": []}, input=[{"id": text}])


def test_the_least_recently_used_are_forgotten_past_the_bound() -> None:
    one = len(msgspec.json.encode(kept("a")))
    store = ResponseStore(max_bytes=3 * one)
    for name in "abc":
        store.put(name, kept(name))
    assert store.get("a") is not None  # now the most recently used
    store.put("d", kept("d"))
    assert store.get("b") is None and len(store) == 3 and store.bytes == 3 * one
    assert [n for n in "acd" if store.get(n) is not None] == ["a", "c", "d"]
    assert store.delete("c") is not None and store.delete("c") is None
    assert store.bytes == 2 * one
    store.put("a", kept("a"))  # again: counted once
    assert store.bytes == 2 * one
    huge = StoredResponse(response={"text": "x" * 4 * one}, input=[])
    store.put("huge", huge)
    assert store.get("huge") is None and store.bytes == 2 * one  # larger than the store


def test_an_id_names_its_frontend() -> None:
    assert keeper("resp_1f_0123abcd") == 0x1F
    for other in ("resp_abc", "msg_1f_x", "resp_zz_x", "resp_1_2_3", ""):
        assert keeper(other) is None


def test_input_items_are_paged_as_openai_lists() -> None:
    items = [{"id": f"m{i}"} for i in range(5)]
    page = input_page(items, limit=2, order="desc", after=None)
    assert [i["id"] for i in page["data"]] == ["m4", "m3"]
    assert (page["first_id"], page["last_id"], page["has_more"]) == ("m4", "m3", True)
    page = input_page(items, limit=2, order="asc", after="m2")
    assert [i["id"] for i in page["data"]] == ["m3", "m4"] and page["has_more"] is False
    assert input_page(items, 2, "asc", "m4")["data"] == []
    with pytest.raises(KeyError):
        input_page(items, 2, "asc", "nope")


class Peers:
    """A stand-in for the client of the other frontends' `responses` endpoints."""

    def __init__(self, fault: type[BaseException] | None) -> None:
        self.fault = fault  # raised by the call; None: it never answers

    def direct(self, lookup: Any, instance: int) -> AsyncIterator[Any]:
        async def answers() -> AsyncIterator[Any]:
            if self.fault is not None:
                raise self.fault("no such instance")
            await asyncio.Event().wait()
            yield None

        return answers()


async def test_a_keeper_gone_is_not_found_and_one_silent_is_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(response_store, "LOOKUP_TIMEOUT_S", 0.05)
    stored = StoredResponses()
    stored._client = Peers(NoInstancesError)  # type: ignore[assignment]
    with pytest.raises(OpenAIError) as gone:
        await stored.get("resp_2_ab", "response_id")
    assert gone.value.status == 404 and gone.value.param == "response_id"
    stored._client = Peers(None)  # type: ignore[assignment]
    with pytest.raises(OpenAIError) as silent:
        await stored.delete("resp_2_ab", "response_id")
    assert silent.value.status == 503 and silent.value.headers == {"retry-after": "1"}
    stored.put("resp_0_cd", kept("cd"))  # this frontend's own: no peer asked
    assert (await stored.get("resp_0_cd", "response_id")).input == [{"id": "cd"}]
