"""A worker's link to the coordinator: register, then heartbeat with load figures.

``CoordinatorLink.run`` loops until ``stop`` is set: it registers (retrying with backoff while
the coordinator is unreachable), then sends a heartbeat every interval the coordinator asked
for; a heartbeat answered ``known=False`` (the coordinator restarted) or failing repeatedly
leads to registering again. ``leave`` (once ``run`` has returned: no heartbeat re-adds the
worker) tells the coordinator the worker drains. Every call has a deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from splitserve.common.errors import SplitserveError
from splitserve.common.event_wait import wait_event
from splitserve.common.kv_events import KvEventLog
from splitserve.common.load import LoadReport
from splitserve.common.membership import WorkerInfo
from splitserve.proto.cluster_access import ClusterAccess
from splitserve.proto.membership_client import MembershipClient

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 2.0
"""Deadline of a registration and a leave."""
HEARTBEAT_TIMEOUT_S = 5.0
"""Deadline of a heartbeat: half the coordinator's expiry (``WorkerRegistry.expiry_s``), so a
heartbeat that a coordinator busy relaying thousands of streams takes late still lands and
counts, where a 2 s deadline had cancelled it (and three such led to registering again, one
more call to the busy coordinator)."""


class CoordinatorLink:
    """Keeps one worker registered with one coordinator."""

    def __init__(
        self,
        coordinator_address: str,
        info: WorkerInfo,
        load: Callable[[], Awaitable[LoadReport]],
        access: ClusterAccess,
        kv_events: KvEventLog | None = None,
    ) -> None:
        """``coordinator_address``: the coordinator's internal port (``--internal-port``);
        ``load``: what each heartbeat reports (figures and readiness); ``kv_events``: the
        worker's prefix-cache changes, each heartbeat carrying those after the last one the
        coordinator answered (all it holds after each registration; None: none sent)."""
        self._address = coordinator_address
        self._info = info
        self._load = load
        self._access = access
        self._kv_events = kv_events

    async def run(self, stop: asyncio.Event) -> None:
        async with self._access.channel(self._address) as channel:
            client = MembershipClient(channel, self._access.credential)
            while not stop.is_set():
                interval_s = await self._register(client, stop)
                if interval_s is None:
                    return
                await self._heartbeat_until_lost(client, stop, interval_s)

    async def leave(self) -> bool:
        """Tell the coordinator this worker drains, so nothing new is routed to it; False
        when that failed (it then stops routing here once heartbeats stay away)."""
        async with self._access.channel(self._address) as channel:
            client = MembershipClient(channel, self._access.credential)
            try:
                await client.leave(self._info.worker_id, CALL_TIMEOUT_S)
            except SplitserveError as error:
                logger.warning("coordinator %s: leave failed: %s", self._address, error)
                return False
        logger.info("left coordinator %s", self._address)
        return True

    async def _register(self, client: MembershipClient, stop: asyncio.Event) -> float | None:
        backoff_s = 0.1
        while not stop.is_set():
            try:
                interval_s = await client.register(self._info, CALL_TIMEOUT_S)
                logger.info("registered with coordinator %s", self._address)
                return max(interval_s, 0.05)
            except SplitserveError as error:
                logger.warning("coordinator %s: register failed: %s", self._address, error)
            await _sleep_or_stop(stop, backoff_s)
            backoff_s = min(backoff_s * 2, 2.0)
        return None

    async def _heartbeat_until_lost(
        self, client: MembershipClient, stop: asyncio.Event, interval_s: float
    ) -> None:
        failures = 0
        cursor: int | None = None  # a fresh registration learns the whole cache
        while not stop.is_set():
            await _sleep_or_stop(stop, interval_s)
            if stop.is_set():
                return
            events = None if self._kv_events is None else self._kv_events.since(cursor)
            try:
                known = await client.heartbeat(
                    self._info.worker_id, await self._load(), HEARTBEAT_TIMEOUT_S, events
                )
            except SplitserveError as error:
                failures += 1
                logger.warning("heartbeat failed (%d): %s", failures, error)
                if failures >= 3:
                    return
                continue
            failures = 0
            if not known:
                logger.info("coordinator forgot this worker; registering again")
                return
            if events is not None:
                cursor = events.seq  # delivered: the next heartbeat carries what follows


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    await wait_event(stop, seconds)
