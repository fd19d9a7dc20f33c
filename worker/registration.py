"""A worker's link to the coordinator: register, then heartbeat with load figures.

``CoordinatorLink.run`` loops until ``stop`` is set: it registers (retrying with backoff while
the coordinator is unreachable), then sends a heartbeat every interval the coordinator asked
for; a heartbeat answered ``known=False`` (the coordinator restarted) or failing repeatedly
leads to registering again. Every call has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import grpc

from splitserve.proto.server import insecure_channel
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc, worker_pb2

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 2.0


class CoordinatorLink:
    """Keeps one worker registered with one coordinator."""

    def __init__(
        self,
        coordinator_address: str,
        info: worker_pb2.WorkerInfo,
        load: Callable[[], Awaitable[worker_pb2.WorkerLoad]],
    ) -> None:
        self._address = coordinator_address
        self._info = info
        self._load = load

    async def run(self, stop: asyncio.Event) -> None:
        async with insecure_channel(self._address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            while not stop.is_set():
                interval_s = await self._register(stub, stop)
                if interval_s is None:
                    return
                await self._heartbeat_until_lost(stub, stop, interval_s)

    async def _register(
        self, stub: coordinator_pb2_grpc.CoordinatorStub, stop: asyncio.Event
    ) -> float | None:
        backoff_s = 0.1
        while not stop.is_set():
            try:
                reply = await stub.RegisterWorker(
                    coordinator_pb2.RegisterWorkerRequest(worker=self._info),
                    timeout=CALL_TIMEOUT_S,
                )
                logger.info("registered with coordinator %s", self._address)
                return max(reply.heartbeat_interval_ms, 50) / 1000
            except grpc.aio.AioRpcError as error:
                logger.warning("coordinator %s: register failed: %s", self._address, error.code())
            await _sleep_or_stop(stop, backoff_s)
            backoff_s = min(backoff_s * 2, 2.0)
        return None

    async def _heartbeat_until_lost(
        self, stub: coordinator_pb2_grpc.CoordinatorStub, stop: asyncio.Event, interval_s: float
    ) -> None:
        failures = 0
        while not stop.is_set():
            await _sleep_or_stop(stop, interval_s)
            if stop.is_set():
                return
            try:
                reply = await stub.Heartbeat(
                    coordinator_pb2.HeartbeatRequest(
                        worker_id=self._info.worker_id, load=await self._load()
                    ),
                    timeout=CALL_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as error:
                failures += 1
                logger.warning("heartbeat failed (%d): %s", failures, error.code())
                if failures >= 3:
                    return
                continue
            failures = 0
            if not reply.known:
                logger.info("coordinator forgot this worker; registering again")
                return


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
