"""Kept responses of OpenAI's Responses API through the official `openai` client, on a real
`kvbaton serve` and a second frontend of its namespace: `previous_response_id` continues a
conversation as the chat answer of the whole conversation would, a kept response is read,
listed and deleted from either frontend, and what is not kept is a 404."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.frontend.conftest import (
    Deployment,
    start_frontend,
    stop_cleanly,
    wait_for_health,
)
from tests.helpers import scraped

pytestmark = pytest.mark.integration


def client_of(deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def replica(served: Deployment) -> Iterator[Deployment]:
    """A second frontend of the namespace (as `serve --frontends 2` runs one)."""
    frontend = start_frontend(served.discovery, "kvbaton")
    wait_for_health(frontend.url, served.model, 1)
    yield frontend
    stop_cleanly(frontend)


ASK: dict[str, Any] = {"temperature": 0, "max_output_tokens": 8}


def test_previous_response_id_continues_the_conversation(served: Deployment) -> None:
    """The answer is the chat answer of the whole conversation: the earlier input, the earlier
    answer, the new input (the earlier instructions are not carried over)."""
    client = client_of(served)
    first = client.responses.create(
        model=served.model, input="What is the capital of France?", instructions="Be terse.", **ASK
    )
    assert first.store is True
    second = client.responses.create(
        model=served.model, input="And of Italy?", previous_response_id=first.id, **ASK
    )
    assert second.previous_response_id == first.id
    chat = client.chat.completions.create(
        model=served.model,
        messages=[
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And of Italy?"},
        ],
        max_tokens=8,
        temperature=0,
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    streamed = list(
        client.responses.create(
            model=served.model,
            input="And of Italy?",
            previous_response_id=first.id,
            stream=True,
            **ASK,
        )
    )
    final = streamed[-1].response
    assert final.output_text == second.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text  # kept too


def test_a_kept_response_is_read_listed_and_deleted(served: Deployment) -> None:
    client = client_of(served)
    first = client.responses.create(model=served.model, input="Hello", **ASK)
    second = client.responses.create(
        model=served.model,
        input="Go on",
        previous_response_id=first.id,
        metadata={"session": "s1"},
        **ASK,
    )
    assert second.metadata == {"session": "s1"}
    again = client.responses.retrieve(second.id)
    assert again.model_dump() == second.model_dump()
    items = client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["message", "message", "message"]
    first_text = items.data[0].content[0]  # type: ignore[union-attr]
    assert (first_text.type, first_text.text) == ("input_text", "Hello")  # type: ignore[union-attr]
    assert all(getattr(i, "status", None) == "completed" for i in items.data)
    roles = [getattr(i, "role", None) for i in items.data]
    assert roles == ["user", "assistant", "user"]
    assert all(i.id for i in items.data)
    newest = client.responses.input_items.list(second.id, limit=1)  # desc, the default
    assert [i.id for i in newest.data] == [items.data[-1].id] and newest.has_more
    rest = client.responses.input_items.list(second.id, limit=5, after=newest.data[0].id)
    assert [i.id for i in rest.data] == [i.id for i in items.data[-2::-1]] and not rest.has_more
    metrics, name = f"{served.url}/metrics", "kvbaton_frontend_kept_responses"
    kept, kept_bytes = scraped(metrics, name), scraped(metrics, f"{name}_bytes")
    assert kept >= 2 and kept_bytes > 0
    client.responses.delete(second.id)
    assert scraped(metrics, name) == kept - 1 and scraped(metrics, f"{name}_bytes") < kept_bytes
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(
            model=served.model, input="More", previous_response_id=second.id, **ASK
        )
    assert raised.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(second.id)


def test_store_false_keeps_nothing(served: Deployment) -> None:
    client = client_of(served)
    response = client.responses.create(model=served.model, input="Hi", store=False, **ASK)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    for missing in ("resp_nothing", "resp_0_0"):
        r = httpx.get(f"{served.url}/v1/responses/{missing}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    kept = client.responses.create(model=served.model, input="Hi", **ASK)
    for query, param in (("stream=true", "stream"), ("starting_after=0", "starting_after")):
        r = httpx.get(f"{served.url}/v1/responses/{kept.id}?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_another_frontend_reads_and_continues_a_kept_response(
    served: Deployment, replica: Deployment
) -> None:
    """Replicas on one port: the next request may reach another frontend than the first."""
    here, there = client_of(served), client_of(replica)
    first = here.responses.create(model=served.model, input="Hello", **ASK)
    assert there.responses.retrieve(first.id).output_text == first.output_text
    answer = there.responses.create(
        model=served.model, input="Go on", previous_response_id=first.id, **ASK
    )
    same = here.responses.create(
        model=served.model, input="Go on", previous_response_id=first.id, **ASK
    )
    assert answer.output_text == same.output_text
    assert here.responses.retrieve(answer.id).output_text == answer.output_text
    there.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        here.responses.retrieve(first.id)


def test_a_frontend_that_keeps_none_says_so(served: Deployment) -> None:
    frontend = start_frontend(served.discovery, "kvbaton", "--responses-store-mib", "0")
    try:
        wait_for_health(frontend.url, served.model, 1)
        client = client_of(frontend)
        response = client.responses.create(model=served.model, input="Hi", **ASK)
        assert response.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response.id)
    finally:
        stop_cleanly(frontend)
