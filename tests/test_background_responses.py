"""Background responses of the Responses API (``gateway/background.py``): through real
gateways in front of the shared served cluster, driven by the ``openai`` SDK as an agent's
client drives them. A background response is answered ``queued`` at once and then, polled,
ends with the text the same request answers in the foreground (greedy); a streamed one goes on
when its client goes away, and resumes from any sequence number with the events the first
stream had; a cancel ends a running one ``cancelled`` and frees the workers; two gateway
processes sharing a SQLite file answer, cancel and resume each other's; a gateway drained by a
real SIGTERM cancels what outlives its drain and says so in the store; a record whose gateway
stopped putting it is answered ``failed``."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.common.response_store import MemoryResponseStore, SqliteResponseStore
from splitserve.gateway import background
from splitserve.gateway.background import STALE_S, BackgroundRuns, answered
from splitserve.gateway.errors import ApiError
from splitserve.gateway.stored_responses import StoredResponse, StoredResponses
from tests.cluster import SERVED_MAX_INFLIGHT, Served, assert_all_free, wait_until_idle
from tests.gateway_support import (
    _error,
    _model,
    gateway_process,
    sdk_fixture,  # noqa: F401 - the fixture sdk, found here by pytest
    served_fixture,  # noqa: F401 - the fixture served, found here by pytest
)
from tests.test_stored_responses import _fresh

ENDED = ("completed", "incomplete", "failed", "cancelled")
LONG = {"max_output_tokens": 400, "extra_body": {"ignore_eos": True}}
"""A response that runs for seconds: long enough to be cancelled while it runs."""


def _until(sdk: openai.OpenAI, response_id: str, done: Any, timeout_s: float = 120.0) -> Any:  # noqa: ANN401
    """The response once ``done(response)`` holds, polled as a client polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = sdk.responses.retrieve(response_id)
        if done(got):
            return got
        assert time.monotonic() < deadline, f"{response_id} stayed {got.status}"
        time.sleep(0.1)


def _ended(sdk: openai.OpenAI, response_id: str) -> Any:  # noqa: ANN401 - the SDK's Response
    return _until(sdk, response_id, lambda got: got.status in ENDED)


def _running(sdk: openai.OpenAI, response_id: str) -> Any:  # noqa: ANN401
    """The response once it runs and has some text."""
    return _until(sdk, response_id, lambda got: got.status == "in_progress" and got.output_text)


def _dumps(events: list[Any]) -> list[dict[str, Any]]:
    return [event.model_dump() for event in events]


def test_a_background_response_is_queued_and_ends_as_in_the_foreground(
    served: Served, sdk: openai.OpenAI
) -> None:
    model = _model(sdk)
    asked = {"model": model, "input": "What is the capital of France?", "temperature": 0,
             "max_output_tokens": 12, "metadata": {"job": "capitals"}}  # fmt: skip
    queued = sdk.responses.create(**asked, background=True, **_fresh())
    assert queued.background is True and queued.status in ("queued", "in_progress")
    assert queued.store is True and queued.usage is None
    ended = _ended(sdk, queued.id)
    foreground = sdk.responses.create(**asked, store=False, **_fresh())
    assert ended.status == foreground.status
    assert ended.output_text == foreground.output_text and ended.output_text
    assert ended.metadata == foreground.metadata == queued.metadata == {"job": "capitals"}
    assert ended.usage.input_tokens == foreground.usage.input_tokens
    assert ended.usage.output_tokens == foreground.usage.output_tokens
    items = sdk.responses.input_items.list(ended.id)
    assert [item.content[0].text for item in items.data] == ["What is the capital of France?"]
    follow = sdk.responses.create(
        model=model, input="And of Italy?", previous_response_id=ended.id, max_output_tokens=8
    )
    assert follow.status in ("completed", "incomplete") and follow.background is False
    # a foreground response cannot be cancelled, nor streamed again
    cancel = httpx.post(f"{served.url}/v1/responses/{follow.id}/cancel", timeout=10)
    assert "background" in _error(cancel, 400)["message"]
    again = httpx.get(f"{served.url}/v1/responses/{follow.id}?stream=true", timeout=10)
    assert _error(again, 400)["param"] == "stream"
    unstored = httpx.post(
        f"{served.url}/v1/responses",
        json={**asked, "background": True, "store": False},
        timeout=10,
    )
    assert _error(unstored, 400)["param"] == "background"


def test_a_streamed_background_response_outlives_its_client_and_resumes(
    served: Served, sdk: openai.OpenAI
) -> None:
    model = _model(sdk)
    asked = {"model": model, "input": "Name three colors.", "temperature": 0,
             "max_output_tokens": 16, "background": True}  # fmt: skip
    events = list(sdk.responses.create(**asked, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert events[0].response.status == "queued" and events[0].response.background is True
    assert [event.sequence_number for event in events] == list(range(len(events)))
    response_id = events[0].response.id
    for after in (-1, 2, len(events) - 2):
        resumed = list(sdk.responses.retrieve(response_id, stream=True, starting_after=after))
        assert _dumps(resumed) == _dumps(events[after + 1 :])
    assert sdk.responses.retrieve(response_id).output_text == events[-1].response.output_text

    # a client that goes away after a few events cancels nothing: the response ends
    with httpx.stream(
        "POST", f"{served.url}/v1/responses", json={**asked, "stream": True}, timeout=30
    ) as opened:
        first = next(
            orjson.loads(line[6:]) for line in opened.iter_lines() if line.startswith("data: ")
        )
    left = first["response"]["id"]
    ended = _ended(sdk, left)
    assert ended.status in ("completed", "incomplete") and ended.output_text
    resumed = list(sdk.responses.retrieve(left, stream=True, starting_after=0))
    assert resumed[0].sequence_number == 1 and resumed[-1].response.id == left


def test_cancel_ends_a_running_background_response_and_frees_the_workers(
    served: Served, sdk: openai.OpenAI
) -> None:
    model = _model(sdk)
    started = sdk.responses.create(model=model, input="Count to a thousand.", background=True,
                                   **LONG)  # fmt: skip
    running = _running(sdk, started.id)
    refused = httpx.post(
        f"{served.url}/v1/responses",
        json={"model": model, "input": "Go on.", "previous_response_id": started.id},
        timeout=10,
    )
    assert _error(refused, 400)["param"] == "previous_response_id"
    cancelled = sdk.responses.cancel(started.id)
    assert cancelled.status == "cancelled" and cancelled.output_text.startswith(running.output_text)
    assert sdk.responses.retrieve(started.id).model_dump() == cancelled.model_dump()
    assert sdk.responses.cancel(started.id).status == "cancelled"  # again: as it is
    assert cancelled.usage.output_tokens < 400
    assert_all_free(wait_until_idle(served.coordinator, 2), 2)


def _requeued(gateway_url: str) -> float:
    """The gateway's background responses sent again after the cluster refused them."""
    text = httpx.get(f"{gateway_url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "splitserve_background_requeued_total"
    )


def test_background_responses_past_the_clusters_admission_wait_queued(
    served: Served, sdk: openai.OpenAI
) -> None:
    """More background responses at once than the cluster admits (``SERVED_MAX_INFLIGHT``):
    the coordinator refuses some, and they stay queued and are sent again later (the gateway
    counts it); none fails."""
    model = _model(sdk)
    requeued_before = _requeued(served.url)
    started = [
        sdk.responses.create(
            model=model,
            input=f"Tell me about the number {i}.",
            background=True,
            max_output_tokens=24,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for i in range(SERVED_MAX_INFLIGHT + 8)
    ]
    ended = [_ended(sdk, response.id) for response in started]
    assert [response.status for response in ended] == ["incomplete"] * len(started)
    assert all(response.usage.output_tokens == 24 for response in ended)
    assert _requeued(served.url) > requeued_before
    assert_all_free(wait_until_idle(served.coordinator, 2), 2)


def test_gateways_sharing_a_store_answer_for_each_others_background_responses(
    served: Served, sdk: openai.OpenAI, tmp_path: Path
) -> None:
    """Gateway B sees A's background responses run, cancels one (B puts the mark, A reads it
    and closes the run) and resumes one's stream."""
    flags = (f"--response-store=sqlite:{tmp_path / 'responses.db'}",)
    started = [gateway_process(served.coordinator, *flags) for _ in range(2)]
    try:
        first, second = (
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            for _, url in started
        )
        model = _model(sdk)
        long = first.responses.create(model=model, input="Count to a thousand.",
                                      background=True, **LONG)  # fmt: skip
        _until(second, long.id, lambda got: got.status == "in_progress")
        cancelled = second.responses.cancel(long.id)
        assert cancelled.status == "cancelled"
        assert first.responses.retrieve(long.id).status == "cancelled"
        events = list(first.responses.create(
            model=model, input="Name a fruit.", max_output_tokens=8, temperature=0,
            background=True, stream=True,
        ))  # fmt: skip
        response_id = events[0].response.id
        assert _ended(second, response_id).output_text == events[-1].response.output_text
        resumed = list(second.responses.retrieve(response_id, stream=True, starting_after=3))
        assert _dumps(resumed) == _dumps(events[4:])
    finally:
        for process, _ in started:
            process.terminate()
        for process, _ in started:
            assert process.wait(timeout=30) == 0
    assert_all_free(wait_until_idle(served.coordinator, 2), 2)


def test_a_draining_gateway_cancels_what_outlives_its_drain(
    served: Served, sdk: openai.OpenAI, tmp_path: Path
) -> None:
    """SIGTERM with a background response running longer than ``--drain-timeout``: the
    gateway exits 0, and the store says the response was cancelled."""
    path = tmp_path / "responses.db"
    process, url = gateway_process(served.coordinator, f"--response-store=sqlite:{path}",
                            "--drain-timeout=1")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        started = client.responses.create(model=_model(sdk), input="Count to a thousand.",
                                          background=True, **LONG)  # fmt: skip
        _running(client, started.id)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
    data = asyncio.run(_read(SqliteResponseStore(path), started.id))
    stored = StoredResponse.from_bytes(data)
    assert stored.response["status"] == "cancelled" and stored.response["output"]
    assert_all_free(wait_until_idle(served.coordinator, 2), 2)


async def _read(store: SqliteResponseStore, key: str) -> bytes:
    try:
        data = await store.get(key)
    finally:
        await store.close()
    assert data is not None
    return data


def test_a_record_its_gateway_stopped_putting_is_answered_failed() -> None:
    """A running record whose heartbeat is older than ``STALE_S`` (its gateway died): GET
    answers it ``failed``, a cancel answers the same, a resumed stream ends with an error
    event after the events the record holds; a fresh one is answered as it is."""

    async def run() -> None:
        store = MemoryResponseStore(1 << 20)
        stored = StoredResponses(store)
        runs = BackgroundRuns(stored)
        response = {"id": "resp-x", "status": "in_progress", "background": True,
                    "error": None, "output": []}  # fmt: skip
        events = [{"type": "response.created", "sequence_number": 0}]
        old = StoredResponse(response, [], "", "", events, time.time() - STALE_S - 1)
        await store.put("resp-x", old.to_bytes(), 60)
        cancelled = await runs.cancel("resp-x", "")
        assert cancelled["status"] == "failed"
        assert cancelled["error"]["code"] == "gateway_stopped"
        batches = [batch async for batch in await runs.follow("resp-x", "", -1)]
        assert batches[0] == events
        assert batches[-1][0]["type"] == "error" and batches[-1][0]["sequence_number"] == 1
        await stored.put_alive("resp-x")  # a sign of life beside the old record: running
        alive = await stored.get("resp-x", "")
        assert alive.running and answered(alive)["status"] == "in_progress"
        fresh = StoredResponse(response, [], "", "", None, time.time())
        await store.put("resp-y", fresh.to_bytes(), 60)
        assert (await stored.get("resp-y", "")).running
        with pytest.raises(ApiError) as refused:
            await runs.follow("resp-y", "", -1)  # kept no events: not created streamed
        assert refused.value.param == "stream"

    asyncio.run(run())


class _CountingStore(MemoryResponseStore):
    """Memory that counts the puts under each key."""

    def __init__(self) -> None:
        super().__init__(1 << 30)
        self.puts: dict[str, int] = {}

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        self.puts[key] = self.puts.get(key, 0) + 1
        await super().put(key, value, ttl_s)


class _Run:
    """What ``BackgroundRuns`` reads of a run while it watches it: a record of ``size``."""

    def __init__(self, response_id: str, size: int) -> None:
        self.response_id = response_id
        self.ended = asyncio.Event()
        self.put_lock = asyncio.Lock()
        self.record_bytes = 0
        response = {"id": response_id, "status": "in_progress", "background": True,
                    "error": None, "output": [{"text": "x" * size}]}  # fmt: skip
        self._record = StoredResponse(response, [], "", "", None)

    def record(self) -> StoredResponse:
        return self._record

    def cancel(self) -> None:
        raise AssertionError("nothing asked to cancel it")


def test_a_large_running_record_is_put_at_a_bounded_rate_with_signs_of_life_between(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each heartbeat puts a small record whole; a large one's record is put once per its
    size over ``SNAPSHOT_BYTES_PER_S`` seconds, a sign of life beside it on the other
    heartbeats, which keeps it from reading as stopped."""
    monkeypatch.setattr(background, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(background, "CANCEL_POLL_S", 0.01)
    monkeypatch.setattr(background, "SNAPSHOT_BYTES_PER_S", 10_000)  # 4 KB: every 0.4 s

    async def run() -> None:
        store = _CountingStore()
        stored = StoredResponses(store)
        runs = BackgroundRuns(stored)
        small, large = _Run("resp-small", 100), _Run("resp-large", 4_000)
        for each in (small, large):
            await runs._put(each)  # as a run's first put (in progress)
        watchers = [asyncio.create_task(runs._watch(each)) for each in (small, large)]
        await asyncio.sleep(1.6)
        for each in (small, large):
            each.ended.set()
        await asyncio.gather(*watchers)
        puts = store.puts
        assert puts.get("resp-small.alive", 0) == 0 and puts["resp-small"] >= 6, puts
        assert puts["resp-large.alive"] >= 2 * puts["resp-large"], puts
        assert 2 <= puts["resp-large"] <= 6, puts  # its first put, then one each 0.4 s
        monkeypatch.setattr(background, "STALE_S", 0.3)
        await stored.put_alive("resp-large")
        await asyncio.sleep(0.35)  # the record older than STALE_S, its sign of life too
        assert background.stale(await stored.get("resp-large", ""))
        await stored.put_alive("resp-large")
        assert not background.stale(await stored.get("resp-large", ""))

    asyncio.run(run())
