"""The Conversations API (``gateway/conversations.py``, ``gateway/conversation_routes.py``) and
Responses requests naming a ``conversation``: a conversation's contract over the stores
(tenants, limits; two gateways' handles of one SQLite file adding at once lose no item), and
through the served cluster's real gateway driven by the ``openai`` SDK: made, read, updated,
its items added, listed, read and deleted as the SDK calls them; a response naming it
answers as the whole conversation sent as input does (greedy, token for token), adds its
turn, and its next turn reuses the KV of the turns before; a background response adds its
turn once it ended."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from splitserve.common.response_store import MemoryResponseStore, SqliteResponseStore
from splitserve.gateway.conversations import Conversations
from splitserve.gateway.errors import ApiError
from splitserve.gateway.metadata import checked_metadata
from splitserve.gateway.stored_responses import StoredResponses, input_items
from tests.cluster import Served
from tests.gateway_support import (
    _error,
    _model,
    gateway_pair_fixture,  # noqa: F401 - the fixture gateway_pair, found here by pytest
    sdk_fixture,  # noqa: F401 - the fixture sdk, found here by pytest
    served_fixture,  # noqa: F401 - the fixture served, found here by pytest
)
from tests.test_stored_responses import _fresh

# ---- the contract over the stores -------------------------------------------------------------


def test_a_conversation_is_its_tenants_and_its_metadata_is_bounded() -> None:
    async def run() -> None:
        conversations = Conversations(StoredResponses(MemoryResponseStore(1 << 20)))
        made = await conversations.create("team-a", input_items("Hello"), {"topic": "x"})
        assert made.conversation_id.startswith("conv_")
        found = await conversations.get(made.conversation_id, "team-a")
        assert found == made and found.items[0]["content"][0]["text"] == "Hello"
        for tenant, conversation_id in (("team-b", made.conversation_id), ("team-a", "conv_x")):
            with pytest.raises(ApiError) as missing:
                await conversations.get(conversation_id, tenant)
            assert missing.value.status == 404 and missing.value.param == "conversation_id"
        await conversations.delete(made.conversation_id, "team-a")
        with pytest.raises(ApiError):
            await conversations.get(made.conversation_id, "team-a")

    asyncio.run(run())
    assert checked_metadata({"a": "b"}) == {"a": "b"}
    for bad in ({str(i): "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}):
        with pytest.raises(ApiError) as refused:
            checked_metadata(bad)
        assert refused.value.status == 400 and str(refused.value.param).startswith("metadata")


def test_two_gateways_adding_at_once_lose_no_item(tmp_path: Path) -> None:
    """Two handles of one SQLite file (two gateway processes of a machine) each add items to
    one conversation at once: every item is kept, once."""

    async def run() -> None:
        path = tmp_path / "responses.db"
        first, second = (
            Conversations(StoredResponses(SqliteResponseStore(path))) for _ in range(2)
        )
        made = await first.create("", [], {})

        async def add(conversations: Conversations, text: str) -> None:
            await conversations.change(
                made.conversation_id,
                "",
                lambda found: dataclasses.replace(found, items=found.items + input_items(text)),
            )

        texts = [f"item {i}" for i in range(16)]
        await asyncio.gather(*(add((first, second)[i % 2], t) for i, t in enumerate(texts)))
        kept = await second.get(made.conversation_id, "")
        assert sorted(item["content"][0]["text"] for item in kept.items) == sorted(texts)
        for each in (first, second):
            await each.stored.close()

    asyncio.run(run())


# ---- through the served cluster's gateway ----------------------------------------------------


def _texts(sdk: openai.OpenAI, conversation_id: str) -> list[str]:
    """The conversation's items' texts, oldest first."""
    items = sdk.conversations.items.list(conversation_id, order="asc", limit=100).data
    return [item.content[0].text for item in items]


def test_a_conversations_turns_answer_as_the_whole_conversation_does(
    served: Served, sdk: openai.OpenAI
) -> None:
    model = _model(sdk)
    opening = {"type": "message", "role": "user", "content": "My name is Ada."}
    made = sdk.conversations.create(items=[opening], metadata={"topic": "names"})
    assert made.id.startswith("conv_") and made.metadata == {"topic": "names"}
    assert sdk.conversations.retrieve(made.id).model_dump() == made.model_dump()
    first = sdk.responses.create(
        model=model, input="What is the capital of France?", conversation=made.id,
        max_output_tokens=12, temperature=0,
    )  # fmt: skip
    assert _texts(sdk, made.id) == [
        "My name is Ada.", "What is the capital of France?", first.output_text,
    ]  # fmt: skip
    follow = sdk.responses.create(
        model=model, input="And of Italy?", conversation={"id": made.id},
        max_output_tokens=12, temperature=0, **_fresh(),
    )  # fmt: skip
    whole = sdk.responses.create(
        model=model,
        input=[
            opening,
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And of Italy?"},
        ],
        max_output_tokens=12, temperature=0, store=False, **_fresh(),
    )  # fmt: skip
    assert follow.output_text == whole.output_text
    assert follow.usage.input_tokens == whole.usage.input_tokens
    # the conversation's id is its session: one decode worker holds the turns before
    third = sdk.responses.create(
        model=model, input="And of Spain?", conversation=made.id, max_output_tokens=4,
        store=False,
    )  # fmt: skip
    assert third.usage.input_tokens_details.cached_tokens > 0
    texts = _texts(sdk, made.id)
    assert texts[3:] == ["And of Italy?", follow.output_text, "And of Spain?", third.output_text]

    # items as the SDK adds, reads, pages and deletes them
    added = sdk.conversations.items.create(
        made.id, items=[{"type": "message", "role": "user", "content": "Noted."}]
    )
    (item,) = added.data
    assert sdk.conversations.items.retrieve(item.id, conversation_id=made.id).id == item.id
    newest = sdk.conversations.items.list(made.id, limit=2)
    assert newest.data[0].id == item.id and newest.has_more is True
    after = sdk.conversations.items.list(made.id, limit=100, after=newest.data[-1].id)
    assert len(after.data) == len(texts) - 1 and after.has_more is False
    sdk.conversations.items.delete(item.id, conversation_id=made.id)
    assert _texts(sdk, made.id) == texts
    assert sdk.conversations.update(made.id, metadata={"topic": "capitals"}).metadata == {
        "topic": "capitals"
    }
    sdk.conversations.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.retrieve(made.id)


def test_what_a_conversation_cannot_take_is_a_clear_error(
    served: Served, sdk: openai.OpenAI
) -> None:
    model = _model(sdk)
    made = sdk.conversations.create()
    url = f"{served.url}/v1/conversations/{made.id}"
    bad_item = {"items": [{"type": "message", "role": "robot", "content": "x"}]}
    assert _error(httpx.post(f"{url}/items", json=bad_item, timeout=10), 400)["param"] == (
        "items.0.role"
    )
    missing = httpx.get(f"{url}/items/msg_nothing", timeout=10)
    assert _error(missing, 404)["param"] == "item_id"
    stored = sdk.responses.create(model=model, input="Hi", max_output_tokens=2)
    both = {"model": model, "input": "Hi", "conversation": made.id,
            "previous_response_id": stored.id}  # fmt: skip
    refused = httpx.post(f"{served.url}/v1/responses", json=both, timeout=30)
    assert _error(refused, 400)["param"] == "conversation"
    unknown = {"model": model, "input": "Hi", "conversation": "conv_nothing"}
    refused = httpx.post(f"{served.url}/v1/responses", json=unknown, timeout=30)
    assert _error(refused, 404)["param"] == "conversation"
    metadata = {"metadata": {"k": "v" * 600}}
    assert _error(httpx.post(url, json=metadata, timeout=10), 400)["param"] == "metadata.k"


def test_a_background_response_adds_its_turn_once_it_ended(
    served: Served, sdk: openai.OpenAI
) -> None:
    made = sdk.conversations.create()
    queued = sdk.responses.create(
        model=_model(sdk), input="Name a color.", conversation=made.id, background=True,
        max_output_tokens=6, temperature=0,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while (ended := sdk.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    while len(_texts(sdk, made.id)) < 2:  # added just after its record's last put
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert _texts(sdk, made.id) == ["Name a color.", ended.output_text]


@pytest.mark.parametrize("gateway_pair", ["etcd"], indirect=True)
def test_two_gateway_processes_on_etcd_adding_at_once_lose_no_item(
    gateway_pair: tuple[str, str], sdk: openai.OpenAI
) -> None:
    """Two real gateway processes sharing a real etcd: items added to one conversation through
    both at once are all kept, once each (etcd's transactions under every change)."""
    clients = [
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) for url in gateway_pair
    ]
    made = clients[0].conversations.create()
    texts = [f"item {i}" for i in range(16)]

    def add(index: int) -> None:
        clients[index % 2].conversations.items.create(
            made.id, items=[{"type": "message", "role": "user", "content": texts[index]}]
        )

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(add, range(len(texts))))
    assert sorted(_texts(clients[1], made.id)) == sorted(texts)


@pytest.mark.parametrize("gateway_pair", ["etcd"], indirect=True)
def test_a_conversation_past_etcds_request_limit_is_kept(gateway_pair: tuple[str, str]) -> None:
    """Two gateway processes on a real etcd: 2.4 MB of items added to a conversation through
    one (a record over etcd's 1.5 MiB request limit, kept in parts: ``common/chunked_store.py``)
    are all listed, in order, through the other."""
    first, second = (
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) for url in gateway_pair
    )
    made = first.conversations.create()
    texts = [f"{i}:" + "x" * 120_000 for i in range(20)]
    for start in (0, 10):
        first.conversations.items.create(
            made.id,
            items=[
                {"type": "message", "role": "user", "content": text}
                for text in texts[start : start + 10]
            ],
        )
    listed = second.conversations.items.list(made.id, limit=100, order="asc")
    assert [item.content[0].text for item in listed.data] == texts  # type: ignore[union-attr]
