"""Refusals at the edge (``client/stream_mux.py``): once a coordinator ends a stream saying it
refuses every new one for a while (``StreamEnd.refuses_all_ms``: its admission queue is full),
the multiplexer refuses the streams started meanwhile itself, with that refusal and what is left
of its hint, and asks the coordinator again once the time is up (real gRPC, in process: a
coordinator whose ``GenerateStreams`` runs the real ``StreamsCall`` and refuses everything);
and the gateway answers such requests at its door (``gateway/edge_refusal.py``; a real
cluster of simulated engines, real HTTP)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import grpc
import httpx
import pytest

from splitserve.client.async_client import AsyncClient
from splitserve.client.errors import RetryPolicy
from splitserve.client.stream_mux import StreamMultiplexer
from splitserve.client.types import Sampling
from splitserve.common.errors import OverloadedError
from splitserve.coordinator.admission import REFUSES_ALL_S
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc
from splitserve.proto.streams_client import QUEUE_FULL_RETRY_AFTER_MS, StreamError
from splitserve.proto.streams_server import Outlet, StreamsCall
from tests.cluster import cluster, metric_total

WINDOW_S = 0.5
HINT_S = 3.0


class _FullCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Refuses every stream as a full admission queue does; counts the ones it was asked."""

    def __init__(self, refuses_all_s: float) -> None:
        self.asked = 0
        self._refuses_all_s = refuses_all_s

    async def GenerateStreams(self, request_iterator, context):  # noqa: ANN001, ANN201, N802
        async def run(request: coordinator_pb2.GenerateRequest, send: object) -> None:
            self.asked += 1
            raise OverloadedError("256 requests already wait for KV", HINT_S, self._refuses_all_s)

        streams = StreamsCall(
            run, lambda: False, coordinator_pb2.StreamsResponse, coordinator_pb2.GenerateResponse
        )
        await streams.serve(request_iterator, context, 30.0)


async def _refusal(relay: StreamMultiplexer) -> StreamError:
    stream = relay.start(coordinator_pb2.GenerateRequest(text="hello"), 10.0, None)
    with pytest.raises(StreamError) as refused:
        async for _ in stream:
            pass
    return refused.value


@contextlib.asynccontextmanager
async def _relay_to(
    servicer: coordinator_pb2_grpc.CoordinatorServicer,
) -> AsyncIterator[StreamMultiplexer]:
    """A real gRPC server of ``servicer`` on a free port, and a multiplexer calling it."""
    server = grpc.aio.server()
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield StreamMultiplexer(channel, RetryPolicy(retry_overloaded=False))
    finally:
        await channel.close(None)
        await server.stop(None)


async def _scenario(refuses_all_s: float) -> tuple[_FullCoordinator, list[StreamError], int]:
    coordinator = _FullCoordinator(refuses_all_s)
    async with _relay_to(coordinator) as relay:
        first = await _refusal(relay)
        crowd = await asyncio.gather(*(_refusal(relay) for _ in range(20)))
        asked_in_window = coordinator.asked
        await asyncio.sleep(WINDOW_S * 1.5)
        after = await _refusal(relay)
        return coordinator, [first, *crowd, after], asked_in_window


def test_a_full_queue_refuses_the_crowd_behind_it_without_a_round_trip() -> None:
    coordinator, refusals, asked_in_window = asyncio.run(_scenario(WINDOW_S))
    first, *crowd, after = refusals
    assert asked_in_window == 1  # the crowd never reached the coordinator
    assert coordinator.asked == 2  # once the window passed, it was asked again
    for refusal in refusals:
        assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "already wait for KV" in refusal.details()
    assert first.retry_after_ms == after.retry_after_ms == HINT_S * 1000
    for refusal in crowd:
        assert "refuses every new request" in refusal.details()
        assert 0 < refusal.retry_after_ms <= HINT_S * 1000  # the hint less the time since


def test_a_refusal_that_says_nothing_of_others_is_asked_each_time() -> None:
    coordinator, refusals, asked_in_window = asyncio.run(_scenario(0.0))
    assert asked_in_window == 21 and coordinator.asked == 22
    assert all(refusal.retry_after_ms == HINT_S * 1000 for refusal in refusals)


class _QueueingCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Admits its first ``room`` streams and queues the rest (neither ever ends): an admission
    queue of limit ``max_queued``, as the real coordinator's items say it."""

    def __init__(self, room: int, max_queued: int) -> None:
        self.asked = 0
        self._room = room
        self._max_queued = max_queued

    async def GenerateStreams(self, request_iterator, context):  # noqa: ANN001, ANN201, N802
        async def run(request: coordinator_pb2.GenerateRequest, outlet: Outlet) -> None:
            self.asked += 1
            if self.asked <= self._room:
                outlet.admitted(self._max_queued)
            await asyncio.Event().wait()

        streams = StreamsCall(
            run, lambda: False, coordinator_pb2.StreamsResponse, coordinator_pb2.GenerateResponse
        )
        await streams.serve(request_iterator, context, 30.0)


def test_a_call_refuses_new_streams_while_the_queues_limit_of_its_streams_wait() -> None:
    """Two streams admitted, three waiting against a limit of three: the sixth is refused at
    once without reaching the coordinator (RESOURCE_EXHAUSTED, a retry hint); once a waiting
    stream is cancelled, the next is sent."""

    async def scenario() -> tuple[int, StreamError, int]:
        coordinator = _QueueingCoordinator(room=2, max_queued=3)
        async with _relay_to(coordinator) as relay:
            request = coordinator_pb2.GenerateRequest(text="hello")
            held = [relay.start(request, 30.0, None) for _ in range(5)]
            readers = [asyncio.ensure_future(anext(stream, None)) for stream in held]
            await _wait_for(lambda: coordinator.asked == 5)
            await _wait_for(lambda: relay.refusal_for(None) is not None)
            asked_before = coordinator.asked
            refusal = await _refusal(relay)
            held[-1].cancel()  # a waiting one
            held.append(relay.start(request, 30.0, None))
            readers.append(asyncio.ensure_future(anext(held[-1], None)))
            await _wait_for(lambda: coordinator.asked == asked_before + 1)
            for stream in held:
                stream.cancel()
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            return asked_before, refusal, coordinator.asked

    asked_before, refusal, asked_after = asyncio.run(scenario())
    assert asked_before == 5
    assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "3 requests already wait for KV (limit 3)" in refusal.details()
    assert refusal.retry_after_ms == QUEUE_FULL_RETRY_AFTER_MS
    assert asked_after == 6


HOLD_TOKENS = 400
"""Tokens each of the KV's holders asks for: simulated steps keep them running for seconds."""


async def _hold(client: httpx.AsyncClient, url: str, streaming: asyncio.Event) -> None:
    """A streamed completion through the gateway that holds its KV (or its queue place)
    until cancelled; ``streaming`` is set at its first bytes (it was admitted)."""
    body = {
        "prompt": "hold the KV",
        "max_tokens": HOLD_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for _ in response.aiter_bytes():
            streaming.set()


async def _hold_over_grpc(coordinator: str) -> None:
    """The same over the coordinator's gRPC API (another client than the gateway)."""
    async with AsyncClient(coordinator, timeout_s=60) as client:
        sampling = Sampling(max_tokens=HOLD_TOKENS, ignore_eos=True)
        async for _ in client.stream("hold the KV", sampling=sampling):
            pass


async def _wait_for(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


WORKER_FLAGS = ("--engine=sim", "--num-blocks=64", "--max-model-len=1024")
"""Simulated engines whose KV holds two ``HOLD_TOKENS`` requests."""
QUEUE_ENV = {"SPLITSERVE_MAX_QUEUED": "2"}
ONE_MORE = {"prompt": "one more", "max_tokens": HOLD_TOKENS, "ignore_eos": True}


def _assert_refused(answer: httpx.Response, message: str) -> None:
    assert answer.status_code == 429
    assert int(answer.headers["retry-after"]) >= 1
    error = answer.json()["error"]
    assert error["type"] == "rate_limit_error" and message in error["message"], error


@pytest.mark.slow  # a call's refusal window is tested above; the gateway's door below
def test_the_gateway_answers_a_full_queues_crowd_at_the_door() -> None:
    """A real cluster (simulated engines) whose KV holds two requests and whose queue holds
    two, filled by another client over gRPC: once the coordinator refused one request for its
    full queue, the gateway answers the next ones itself (429, Retry-After, OpenAI's body)
    without the coordinator counting them, and asks it again after the window."""
    lines: dict[str, str] = {}
    with cluster(1, 1, *WORKER_FLAGS, ready_lines=lines, env=QUEUE_ENV) as coordinator:
        url = lines["splitserve gateway ready"]
        metrics = lines["coordinator metrics"]

        def refusals() -> float:
            return metric_total(metrics, "splitserve_admission_refusals_total")

        async def scenario() -> list[httpx.Response]:
            holders = [asyncio.create_task(_hold_over_grpc(coordinator)) for _ in range(4)]
            async with httpx.AsyncClient(timeout=30) as client:
                queued = "splitserve_admission_queued_requests"
                await _wait_for(lambda: metric_total(metrics, queued) == 2)
                answers = [await client.post(f"{url}/v1/completions", json=ONE_MORE)]
                counted = refusals()
                for _ in range(5):  # within REFUSES_ALL_S of the first refusal
                    answers.append(await client.post(f"{url}/v1/completions", json=ONE_MORE))
                assert refusals() == counted  # answered at the door
                await asyncio.sleep(REFUSES_ALL_S * 2)
                answers.append(await client.post(f"{url}/v1/completions", json=ONE_MORE))
                assert refusals() == counted + 1  # the window passed: asked again
            for holder in holders:
                holder.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return answers

        answers = asyncio.run(scenario())
        for answer in answers:
            _assert_refused(answer, "already wait for KV")
        door = answers[1:-1]
        assert all("refuses every new request" in a.json()["error"]["message"] for a in door)


def test_the_gateway_refuses_at_the_door_while_its_own_streams_fill_the_queue() -> None:
    """The same cluster, its KV and queue filled through the gateway: the coordinator's
    ``admitted`` items tell the gateway which of its streams still wait, and with two waiting
    (the queue's limit) the next request is answered at the door before the coordinator ever
    refused one; once the holders are gone, requests reach the coordinator again and are
    served."""
    lines: dict[str, str] = {}
    with cluster(1, 1, *WORKER_FLAGS, ready_lines=lines, env=QUEUE_ENV):
        url = lines["splitserve gateway ready"]
        metrics = lines["coordinator metrics"]

        def refusals() -> float:
            return metric_total(metrics, "splitserve_admission_refusals_total")

        async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                # Two that take the KV first, streaming before the two that queue are sent: a
                # stream counts as waiting until its ``admitted`` item is back, so four at once
                # could meet an early refusal at the door (``refusal_at``'s burst rule).
                streaming = [asyncio.Event() for _ in range(4)]
                holders = [asyncio.create_task(_hold(client, url, e)) for e in streaming[:2]]
                await _wait_for(lambda: all(event.is_set() for event in streaming[:2]))
                holders += [asyncio.create_task(_hold(client, url, e)) for e in streaming[2:]]
                queued = "splitserve_admission_queued_requests"
                await _wait_for(lambda: metric_total(metrics, queued) == 2)
                await _wait_for(lambda: sum(event.is_set() for event in streaming) == 2)
                answers = [
                    await client.post(f"{url}/v1/completions", json=ONE_MORE) for _ in range(2)
                ]
                # the Responses API's route is answered at the door too, its body unread (a
                # body the handler would refuse with a 400 gets the door's 429)
                unread = {"input": 5}
                answers.append(await client.post(f"{url}/v1/responses", json=unread))
                assert refusals() == 0  # the coordinator was never asked
                for holder in holders:
                    holder.cancel()
                await asyncio.gather(*holders, return_exceptions=True)
                await _wait_for(lambda: metric_total(metrics, queued) == 0)
                short = {"prompt": "after", "max_tokens": 4}
                return answers, await client.post(f"{url}/v1/completions", json=short)

        answers, after = asyncio.run(scenario())
        for answer in answers:
            _assert_refused(answer, "queue is full: 2 requests already wait for KV (limit 2)")
        assert after.status_code == 200, after.text
        assert refusals() == 0
