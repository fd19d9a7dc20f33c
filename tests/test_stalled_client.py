"""A client that stops reading its stream is cut after a bounded time, and its request is
aborted on every worker (real stack: the shared ``served_cluster``, whose coordinator cuts a
client that read nothing for ``SERVED_STALL_TIMEOUT_S``, 2 s).

The client opens a long stream over a channel with a small HTTP/2 window, reads its first
response, then reads nothing: the coordinator's writes block once the window is full, and
after the timeout the request must end (every block free again) long before its 4,000
tokens could have been generated, while another client's request is served normally.
When the stalled client reads again it finds the call ended ABORTED.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from splitserve.client import Client, Sampling
from splitserve.proto.splitserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.cluster import Served, assert_all_free, wait_until_idle, worker_loads

LONG_TOKENS = 4000
SMALL_WINDOW = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))


@pytest.fixture(scope="module")
def coordinator(served_cluster: Served) -> str:
    return served_cluster.coordinator


def _busy(address: str) -> bool:
    return any(
        load.num_running_requests or load.num_used_blocks for load in worker_loads(address).values()
    )


@pytest.mark.timeout(240)
def test_a_client_that_stops_reading_is_cut_and_its_request_aborted(coordinator: str) -> None:
    async def scenario() -> tuple[float, grpc.StatusCode | None]:
        async with grpc.aio.insecure_channel(coordinator, options=SMALL_WINDOW) as channel:
            call = coordinator_pb2_grpc.CoordinatorStub(channel).Generate(
                coordinator_pb2.GenerateRequest(
                    text="Count from one to ten thousand:",
                    sampling=common_pb2.SamplingParams(
                        max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True
                    ),
                )
            )
            await call.read()  # the stream started; from here on nothing is read
            started = time.monotonic()
            while _busy(coordinator):
                assert time.monotonic() - started < 60, "the stalled request kept running"
                await asyncio.sleep(0.5)
            freed_after_s = time.monotonic() - started
            with Client(coordinator) as other:  # the others were never affected
                served = other.generate("Hello", sampling=Sampling(max_tokens=4, temperature=0))
                assert served.usage.completion_tokens == 4
            code = None
            try:
                while await call.read() is not grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError as error:
                code = error.code()
            return freed_after_s, code

    freed_after_s, code = asyncio.run(scenario())
    assert code == grpc.StatusCode.ABORTED
    # 4,000 tokens take minutes here; the stall cut it within the window plus the timeout
    assert freed_after_s < 60
    assert_all_free(wait_until_idle(coordinator, 2), 2)
