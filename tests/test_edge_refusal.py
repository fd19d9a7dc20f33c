"""Refusals at the edge (``client/stream_mux.py``): once a coordinator ends a stream saying it
refuses every new one for a while (``StreamEnd.refuses_all_ms``: its admission queue is full),
the multiplexer refuses the streams started meanwhile itself, with that refusal and what is left
of its hint, and asks the coordinator again once the time is up (real gRPC, in process: a
coordinator whose ``GenerateStreams`` runs the real ``StreamsCall`` and refuses everything);
and the gateway answers such requests at its door (``gateway/edge_refusal.py``; a real
cluster of simulated engines, real HTTP)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import httpx
import pytest

from splitserve.client.errors import RetryPolicy
from splitserve.client.stream_mux import StreamMultiplexer
from splitserve.common.errors import OverloadedError
from splitserve.coordinator.admission import REFUSES_ALL_S
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc
from splitserve.proto.streams_client import StreamError
from splitserve.proto.streams_server import StreamsCall
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


async def _scenario(refuses_all_s: float) -> tuple[_FullCoordinator, list[StreamError], int]:
    coordinator = _FullCoordinator(refuses_all_s)
    server = grpc.aio.server()
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        relay = StreamMultiplexer(channel, RetryPolicy(retry_overloaded=False))
        first = await _refusal(relay)
        crowd = await asyncio.gather(*(_refusal(relay) for _ in range(20)))
        asked_in_window = coordinator.asked
        await asyncio.sleep(WINDOW_S * 1.5)
        after = await _refusal(relay)
        return coordinator, [first, *crowd, after], asked_in_window
    finally:
        await channel.close(None)
        await server.stop(None)


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


HOLD_TOKENS = 400
"""Tokens each of the KV's holders asks for: simulated steps keep them running for seconds."""


async def _hold(client: httpx.AsyncClient, url: str) -> None:
    """A streamed completion that holds its KV (or its queue place) until cancelled."""
    body = {
        "prompt": "hold the KV",
        "max_tokens": HOLD_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for _ in response.aiter_bytes():
            pass


async def _wait_for(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_the_gateway_answers_a_full_queues_crowd_at_the_door() -> None:
    """A real cluster (simulated engines) whose KV holds two requests and whose queue holds
    two: once the coordinator refused one request for its full queue, the gateway answers the
    next ones itself (429, Retry-After, OpenAI's body) without the coordinator counting them,
    and asks it again after the window."""
    lines: dict[str, str] = {}
    env = {"SPLITSERVE_MAX_QUEUED": "2"}
    worker_flags = ("--engine=sim", "--num-blocks=64", "--max-model-len=1024")
    with cluster(1, 1, *worker_flags, ready_lines=lines, env=env):
        url = lines["splitserve gateway ready"]
        metrics = lines["coordinator metrics"]

        def refusals() -> float:
            return metric_total(metrics, "splitserve_admission_refusals_total")

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                holders = [asyncio.create_task(_hold(client, url)) for _ in range(4)]
                queued = "splitserve_admission_queued_requests"
                await _wait_for(lambda: metric_total(metrics, queued) == 2)
                body = {"prompt": "one more", "max_tokens": HOLD_TOKENS, "ignore_eos": True}
                answers = [await client.post(f"{url}/v1/completions", json=body)]
                counted = refusals()
                for _ in range(5):  # within REFUSES_ALL_S of the first refusal
                    answers.append(await client.post(f"{url}/v1/completions", json=body))
                assert refusals() == counted  # answered at the door
                await asyncio.sleep(REFUSES_ALL_S * 2)
                answers.append(await client.post(f"{url}/v1/completions", json=body))
                assert refusals() == counted + 1  # the window passed: asked again
                for holder in holders:
                    holder.cancel()
                await asyncio.gather(*holders, return_exceptions=True)
                return answers

        answers = asyncio.run(scenario())
        for answer in answers:
            assert answer.status_code == 429
            assert int(answer.headers["retry-after"]) >= 1
            error = answer.json()["error"]
            assert error["type"] == "rate_limit_error" and "already wait for KV" in error["message"]
        door = answers[1:-1]
        assert all("refuses every new request" in a.json()["error"]["message"] for a in door)
