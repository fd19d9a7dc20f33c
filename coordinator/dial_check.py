"""Dial back a worker that registered over gRPC before routing to it.

A registration and its heartbeats travel worker -> coordinator; they prove nothing about the
way back. A worker that advertises a wrong host, or sits behind a one-way partition, would
look healthy and idle and take every first attempt, each failing after a connect timeout.
``DialCheck.verify`` opens the worker's load stream at its advertised address and marks the
record dialled once the first report arrives (``WorkerRegistry.mark_dialled``); until then
the registry does not route to it. Failures are logged once per worker, then retried every
``RETRY_S`` while the same registration stands.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from splitserve.common.errors import SplitserveError
from splitserve.coordinator.registry import WorkerRegistry
from splitserve.proto.worker_clients import WorkerChannels

logger = logging.getLogger(__name__)

DIAL_TIMEOUT_S = 3.0
RETRY_S = 2.0


class DialCheck:
    """One verification task per registered worker (a newer registration replaces it)."""

    def __init__(self, registry: WorkerRegistry, channels: WorkerChannels) -> None:
        self._registry = registry
        self._channels = channels
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def verify(self, worker_id: str, address: str) -> None:
        """Start dialling ``worker_id`` at ``address`` back (call on the event loop)."""
        previous = self._tasks.pop(worker_id, None)
        if previous is not None:
            previous.cancel()
        task = asyncio.create_task(self._dial(worker_id, address), name=f"dial-{worker_id}")
        self._tasks[worker_id] = task
        task.add_done_callback(lambda done: self._forget(worker_id, done))

    def _forget(self, worker_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(worker_id) is task:
            del self._tasks[worker_id]

    async def _dial(self, worker_id: str, address: str) -> None:
        warned = False
        while self._registered(worker_id, address):
            try:
                await asyncio.wait_for(self._first_report(address), DIAL_TIMEOUT_S)
            except (SplitserveError, TimeoutError) as error:
                if not warned:
                    logger.warning(
                        "worker %s registered at %s but cannot be reached there (%s); not "
                        "routing to it until it can",
                        worker_id,
                        address,
                        error or "no answer",
                    )
                    warned = True
                await asyncio.sleep(RETRY_S)
                continue
            if self._registry.mark_dialled(worker_id, address) and warned:
                logger.info("worker %s is reachable at %s now", worker_id, address)
            return

    def _registered(self, worker_id: str, address: str) -> bool:
        record = self._registry.get(worker_id)
        return record is not None and record.address == address and not record.dialled

    async def _first_report(self, address: str) -> None:
        reports = self._channels.monitor(address).watch_load(interval_s=60.0)
        async with contextlib.aclosing(reports):
            await anext(reports)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
