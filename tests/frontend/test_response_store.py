"""The Responses API's kept responses (`frontend/response_store.py`): bounded by bytes, the
least recently used forgotten first; ids that name their frontend; pages of input items."""

from __future__ import annotations

import msgspec
import pytest

from kvbaton.frontend.response_store import ResponseStore, input_page, keeper
from kvbaton.protocols.stored_responses import StoredResponse


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
