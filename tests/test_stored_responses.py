"""Stored responses of the Responses API (``gateway/stored_responses.py``,
``gateway/response_routes.py``): the three stores' contract (``common/response_store.py``,
etcd on a real etcd server), a tenant reading only its own, and through real gateways in front
of the shared served cluster, driven by the ``openai`` SDK: ``previous_response_id`` answers
as the whole conversation sent as input does (greedy, token for token, its prompt's tokens
counted alike, its earlier turns' KV reused), ``retrieve``, ``input_items.list`` and
``delete``; two gateway processes sharing a SQLite file, and two sharing etcd, each continue
the other's responses."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from splitserve.common.response_store import (
    MemoryResponseStore,
    SqliteResponseStore,
    StoreFailed,
)
from splitserve.discovery.etcd_response_store import EtcdResponseStore
from splitserve.gateway.errors import ApiError
from splitserve.gateway.stored_responses import (
    StoredResponse,
    StoredResponses,
    conversation,
    input_items,
)
from splitserve.proto.etcd_client import EtcdClient
from tests.cluster import Served
from tests.etcd import EtcdServer
from tests.gateway_support import (
    _error,
    _model,
    gateway_pair_fixture,  # noqa: F401 - the fixture gateway_pair, found here by pytest
    gateway_process,
    sdk_fixture,  # noqa: F401 - the fixture sdk, found here by pytest
    served_fixture,  # noqa: F401 - the fixture served, found here by pytest
)
from tests.test_gateway_responses import WEATHER

# ---- the stores -----------------------------------------------------------------------------


async def _contract(store: Any, ttl_s: float = 60.0) -> None:  # noqa: ANN401 - any backend
    """What every store does: a value read back until deleted, replaced by a later put,
    unknown keys None, delete saying whether it held the key."""
    assert await store.get("resp-a") is None
    await store.put("resp-a", b"one", ttl_s)
    await store.put("resp-b", b"two", ttl_s)
    assert await store.get("resp-a") == b"one"
    await store.put("resp-a", b"uno", ttl_s)
    assert await store.get("resp-a") == b"uno"
    assert await store.delete("resp-a") is True
    assert await store.get("resp-a") is None
    assert await store.delete("resp-a") is False
    assert await store.get("resp-b") == b"two"
    # replace: only over the value expected (None: none)
    assert await store.replace("resp-b", b"three", ttl_s, b"one") is False
    assert await store.replace("resp-b", b"three", ttl_s, None) is False
    assert await store.get("resp-b") == b"two"
    assert await store.replace("resp-b", b"three", ttl_s, b"two") is True
    assert await store.get("resp-b") == b"three"
    assert await store.replace("resp-c", b"new", ttl_s, b"x") is False
    assert await store.get("resp-c") is None
    assert await store.replace("resp-c", b"new", ttl_s, None) is True
    assert await store.replace("resp-c", b"newer", ttl_s, None) is False
    assert await store.get("resp-c") == b"new"
    assert await store.delete("resp-c") is True


async def _replaces_lose_no_write(first: Any, second: Any) -> None:  # noqa: ANN401
    """Two handles (two gateways) adding to one value at once, each a read then a
    ``replace`` retried until it holds: every addition is kept."""

    async def add(store: Any, mark: bytes) -> None:  # noqa: ANN401
        while True:
            seen = await store.get("counted")
            if await store.replace("counted", (seen or b"") + mark, 60, seen):
                return

    marks = [bytes([ord("a") + i]) for i in range(12)]
    await asyncio.gather(*(add((first, second)[i % 2], mark) for i, mark in enumerate(marks)))
    assert sorted(await second.get("counted")) == sorted(b"".join(marks))


def test_memory_store_keeps_expires_and_drops_the_least_recently_used() -> None:
    async def run() -> None:
        store = MemoryResponseStore(max_bytes=10)
        await _contract(store)
        await store.put("short", b"x", 0.05)
        await asyncio.sleep(0.1)
        assert await store.get("short") is None and await store.delete("short") is False
        await store.put("c", b"cccc", 60)  # resp-b (5) + c (4) + d (4) > 10: c goes
        await store.get("resp-b")  # read: now the most recently used
        await store.put("d", b"dddd", 60)
        assert await store.get("c") is None
        assert await store.get("resp-b") == b"three" and await store.get("d") == b"dddd"
        assert store.bytes == 9
        with pytest.raises(StoreFailed, match="--response-store-bytes"):
            await store.put("big", b"x" * 11, 60)

    asyncio.run(run())


def test_sqlite_store_is_shared_by_two_handles_of_one_file(tmp_path: Path) -> None:
    """Two handles of one file, as two gateway processes of a machine hold it: one's puts
    are the other's, expiry by the clock they share."""

    async def run() -> None:
        first = SqliteResponseStore(tmp_path / "responses.db")
        second = SqliteResponseStore(tmp_path / "responses.db")
        await _contract(first)
        assert await second.get("resp-b") == b"three"
        await _replaces_lose_no_write(first, second)
        await second.put("resp-c", b"three", 0.05)
        assert await first.get("resp-c") == b"three"
        await asyncio.sleep(0.1)
        assert await first.get("resp-c") is None and await second.delete("resp-c") is False
        await first.close()
        await second.close()

    asyncio.run(run())


def test_etcd_store_on_a_real_etcd(etcd: EtcdServer) -> None:
    """A real etcd: the contract, values under leases that end them (one lease for the puts
    of a minute), another store of the same cluster reads them, another cluster does not."""

    async def run() -> None:
        store = EtcdResponseStore(EtcdClient((etcd.endpoint,)), "blue")
        await _contract(store)
        await store.put("resp-x", b"x", 60)
        other = EtcdResponseStore(EtcdClient((etcd.endpoint,)), "blue")
        await _replaces_lose_no_write(store, other)
        assert await other.get("resp-x") == b"x"
        elsewhere = EtcdResponseStore(EtcdClient((etcd.endpoint,)), "green")
        assert await elsewhere.get("resp-x") is None
        kept = await store.client.get(b"/splitserve/blue/responses/resp-x")
        assert kept is not None and kept.lease != 0
        assert kept.lease == (await store.client.get(b"/splitserve/blue/responses/resp-b")).lease
        # a lease that ends takes its values with it
        assert store._lease is not None
        await store.client.revoke(store._lease)
        assert await other.get("resp-x") is None
        await store.put("resp-y", b"y", 60)  # a new lease for the next puts
        assert await other.get("resp-y") == b"y"
        for each in (store, other, elsewhere):
            await each.close()

    asyncio.run(run())


# ---- records, tenants, conversations --------------------------------------------------------


def _record(response_id: str, tenant: str, output: list[dict[str, Any]]) -> StoredResponse:
    items = input_items("Hello")
    return StoredResponse({"id": response_id, "output": output}, items, tenant, "s-1")


def test_a_tenant_reads_only_its_own_and_nothing_is_said_of_others() -> None:
    async def run() -> None:
        stored = StoredResponses(MemoryResponseStore(1 << 20))
        await stored.put(_record("resp-1", "blue", []))
        assert (await stored.get("resp-1", "blue")).session_id == "s-1"
        for tenant, response_id in (("green", "resp-1"), ("blue", "resp-2")):
            with pytest.raises(ApiError) as refused:
                await stored.get(response_id, tenant, "previous_response_id")
            assert refused.value.status == 404 and refused.value.param == "previous_response_id"
        with pytest.raises(ApiError):
            await stored.delete("resp-1", "green")
        await stored.delete("resp-1", "blue")
        with pytest.raises(ApiError):
            await stored.get("resp-1", "blue")

    asyncio.run(run())


def test_with_no_store_store_true_is_a_400_and_false_stores_nothing() -> None:
    stored = StoredResponses(None)
    assert stored.stores(None) is False and stored.stores(False) is False
    with pytest.raises(ApiError) as refused:
        stored.stores(True)
    assert refused.value.status == 400 and refused.value.param == "store"
    on = StoredResponses(MemoryResponseStore(1 << 20))
    assert on.stores(None) is True and on.stores(False) is False


def test_a_failed_put_is_counted_not_raised() -> None:
    async def run() -> None:
        registry = CollectorRegistry()
        stored = StoredResponses(MemoryResponseStore(8), registry=registry)
        await stored.put(_record("resp-1", "", []))
        assert stored.failed_puts == 1
        assert registry.get_sample_value("splitserve_response_store_failures_total") == 1
        with pytest.raises(ApiError) as missing:
            await stored.get("resp-1", "")
        assert missing.value.status == 404

    asyncio.run(run())


def test_input_items_get_ids_and_parts_and_a_follow_up_drops_reasoning() -> None:
    items = input_items(
        [
            {"role": "user", "content": "Hi"},
            {"type": "message", "role": "assistant", "content": "Hello", "id": "msg_mine"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ]
    )
    assert [item["type"] for item in items] == [
        "message", "message", "function_call", "function_call_output",
    ]  # fmt: skip
    assert items[0]["content"] == [{"type": "input_text", "text": "Hi"}]
    assert items[1]["content"] == [{"type": "output_text", "text": "Hello"}]
    assert items[1]["id"] == "msg_mine"
    assert [item["id"][:3] for item in (items[0], items[2], items[3])] == ["msg", "fc_", "fco"]
    assert len({item["id"] for item in items}) == 4
    reasoning = {"type": "reasoning", "id": "rs_1", "content": []}
    message = {"type": "message", "id": "msg_2", "role": "assistant", "content": []}
    follow = conversation(_record("resp-1", "", [reasoning, message]))
    assert [item["id"] for item in follow][-1] == "msg_2" and reasoning not in follow


# ---- through the served cluster's gateway ----------------------------------------------------


def _fresh() -> dict[str, Any]:
    """A ``cache_salt`` of its own: the request shares no cached KV, so two compared requests
    both compute their whole prompt (a prefix computed in another split of steps may differ
    in the last bits, and a near tie of greedy tokens with it)."""
    return {"extra_body": {"cache_salt": uuid.uuid4().hex}}


def _create(sdk: openai.OpenAI, **fields: Any) -> Any:  # noqa: ANN401 - the SDK's Response
    fields.setdefault("max_output_tokens", 12)
    return sdk.responses.create(model=_model(sdk), temperature=0, **fields)


def test_a_follow_up_answers_as_the_whole_conversation_does(
    served: Served, sdk: openai.OpenAI
) -> None:
    first = _create(sdk, input="What is the capital of France?", instructions="Be brief.")
    assert first.store is True and first.previous_response_id is None
    follow = _create(
        sdk, input="And of Italy?", previous_response_id=first.id, instructions="Be brief."
    )
    assert follow.previous_response_id == first.id and follow.store is True
    conversation_items = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Italy?"},
    ]
    # the conversation's turns go to one decode worker, which holds the first turn's KV
    assert follow.usage.input_tokens_details.cached_tokens > 0
    fresh = _create(
        sdk, input="And of Italy?", previous_response_id=first.id, instructions="Be brief.",
        store=False, **_fresh(),
    )  # fmt: skip
    whole = _create(
        sdk, input=conversation_items, instructions="Be brief.", store=False, **_fresh()
    )
    assert fresh.output_text == whole.output_text
    assert fresh.usage.input_tokens_details.cached_tokens == 0  # the salt: nothing shared
    assert follow.usage.input_tokens == fresh.usage.input_tokens == whole.usage.input_tokens
    # the first's instructions are not carried over: a follow-up without them is the
    # conversation without them
    bare = _create(
        sdk, input="And of Italy?", previous_response_id=first.id, store=False, **_fresh()
    )
    whole_bare = _create(sdk, input=conversation_items, store=False, **_fresh())
    assert bare.usage.input_tokens == whole_bare.usage.input_tokens != follow.usage.input_tokens
    assert bare.output_text == whole_bare.output_text

    got = sdk.responses.retrieve(follow.id)
    assert got.model_dump() == follow.model_dump()
    items = sdk.responses.input_items.list(follow.id, order="asc")
    texts = [item.content[0].text for item in items.data]
    assert texts == ["What is the capital of France?", first.output_text, "And of Italy?"]
    assert items.data[1].id == first.output[0].id  # the previous output, as it was answered
    page = sdk.responses.input_items.list(follow.id, limit=2)  # newest first by default
    assert [item.id for item in page.data] == [items.data[2].id, items.data[1].id]
    assert page.has_more is True
    rest = sdk.responses.input_items.list(follow.id, limit=2, after=page.data[-1].id)
    assert [item.id for item in rest.data] == [items.data[0].id] and rest.has_more is False


def test_a_streamed_response_is_stored_before_its_last_event(
    served: Served, sdk: openai.OpenAI
) -> None:
    final = None
    with sdk.responses.stream(
        model=_model(sdk), input="Hello", max_output_tokens=6, temperature=0
    ) as stream:
        for event in stream:
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
                # asked at once, before the stream's end is read
                assert sdk.responses.retrieve(final.id).id == final.id
    assert final is not None and final.store is True
    assert sdk.responses.retrieve(final.id).output_text == final.output_text


def test_a_tool_round_continues_from_the_stored_call(served: Served, sdk: openai.OpenAI) -> None:
    question = "What is the weather in Paris?"
    forced = {"type": "function", "name": "get_weather"}
    call = _create(sdk, input=question, tools=[WEATHER], tool_choice=forced, max_output_tokens=60)
    called = [item for item in call.output if item.type == "function_call"]
    assert called and called[0].name == "get_weather"
    answer = {"type": "function_call_output", "call_id": called[0].call_id, "output": "sunny"}
    follow = _create(sdk, input=[answer], previous_response_id=call.id, tools=[WEATHER], **_fresh())
    whole = _create(
        sdk,
        input=[
            {"role": "user", "content": question},
            *[item.model_dump(exclude_none=True) for item in called],
            answer,
        ],
        tools=[WEATHER],
        store=False,
        **_fresh(),
    )
    assert follow.output_text == whole.output_text
    assert follow.usage.input_tokens == whole.usage.input_tokens


def test_unstored_deleted_and_unknown_responses_are_404s(
    served: Served, sdk: openai.OpenAI
) -> None:
    unstored = _create(sdk, input="Hello", store=False)
    assert unstored.store is False
    stored = _create(sdk, input="Hello")
    deleted = httpx.delete(f"{served.url}/v1/responses/{stored.id}", timeout=10)
    assert deleted.json() == {"id": stored.id, "object": "response", "deleted": True}
    for response_id in (unstored.id, stored.id, "resp-nothing"):
        got = httpx.get(f"{served.url}/v1/responses/{response_id}", timeout=10)
        assert _error(got, 404)["code"] == "not_found"
        body = {"model": _model(sdk), "input": "Hi", "previous_response_id": response_id}
        refused = httpx.post(f"{served.url}/v1/responses", json=body, timeout=30)
        assert _error(refused, 404)["param"] == "previous_response_id"
    assert _error(httpx.delete(f"{served.url}/v1/responses/{stored.id}", timeout=10), 404)
    kept = _create(sdk, input="Hello")
    for query, param in (
        ("stream=true", "stream"),
        ("include=file_search_call.results", "include"),
    ):
        got = httpx.get(f"{served.url}/v1/responses/{kept.id}?{query}", timeout=10)
        assert _error(got, 400)["param"] == param
    listed = httpx.get(f"{served.url}/v1/responses/{kept.id}/input_items?after=x", timeout=10)
    assert _error(listed, 400)["param"] == "after"


# ---- gateways that share a store ------------------------------------------------------------


@pytest.mark.parametrize("gateway_pair", ["sqlite", "etcd"], indirect=True)
def test_gateways_sharing_a_store_continue_each_others_responses(
    gateway_pair: tuple[str, str], sdk: openai.OpenAI
) -> None:
    first, second = (
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) for url in gateway_pair
    )
    model = _model(sdk)
    opened = first.responses.create(
        model=model, input="What is the capital of France?", max_output_tokens=8, temperature=0
    )
    follow = second.responses.create(
        model=model, input="And of Italy?", previous_response_id=opened.id,
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    assert first.responses.retrieve(follow.id).output_text == follow.output_text
    assert second.responses.retrieve(opened.id).id == opened.id
    first.responses.delete(follow.id)
    with pytest.raises(openai.NotFoundError):
        second.responses.retrieve(follow.id)


def test_a_tenant_reads_only_its_own_through_a_keyed_gateway(
    served: Served, sdk: openai.OpenAI, tmp_path: Path
) -> None:
    """A gateway with API keys of two tenants (one with two keys): a response stored by one
    tenant is the other's 404 (retrieved, listed, deleted or continued), any key of its own
    tenant's to read."""
    keys = tmp_path / "keys"
    keys.write_text("sk-a-1 team-a\nsk-a-2 team-a\nsk-b team-b\n")
    process, url = gateway_process(served.coordinator, f"--api-keys-file={keys}")
    try:
        owner, colleague, stranger = (
            openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            for key in ("sk-a-1", "sk-a-2", "sk-b")
        )
        model = _model(sdk)
        stored = owner.responses.create(
            model=model, input="Hello", max_output_tokens=4, temperature=0
        )
        assert colleague.responses.retrieve(stored.id).id == stored.id
        with pytest.raises(openai.NotFoundError):
            stranger.responses.retrieve(stored.id)
        with pytest.raises(openai.NotFoundError):
            stranger.responses.input_items.list(stored.id)
        with pytest.raises(openai.NotFoundError):
            stranger.responses.delete(stored.id)
        with pytest.raises(openai.NotFoundError):
            stranger.responses.create(
                model=model, input="Hi", previous_response_id=stored.id, max_output_tokens=4
            )
        assert owner.responses.retrieve(stored.id).output_text == stored.output_text
    finally:
        process.terminate()
        process.wait(timeout=30)
