"""The coordinator's registry fed from a ``MembershipWatcher`` (etcd) and the workers' load
streams.

``MembershipFollower.run`` registers every member of the watcher's snapshot, then applies
each change: ``Joined`` registers the worker (replacing older info) and starts following its
load (``WorkerMonitor.WatchLoad``, one stream per worker, every ``LOAD_INTERVAL_S``), each
figure counting as a heartbeat; ``Left`` stops that, drops the worker from the registry and
lets the router forget it. A broken load stream marks the worker failed (not routed to) and
is opened again after a back-off while the worker stays a member; a worker the registry
expired for silence is registered again by its next figure. While etcd is unreachable the
watcher keeps the last membership, so serving goes on.

Invariant: a worker is in the registry only while it is a member (or, between a ``Left`` and
its processing, for no ``await``), and has at most one load-following task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from splitserve.common.errors import MembershipStoreError, SplitserveError
from splitserve.common.kv_events import KvEvents
from splitserve.common.membership import WorkerInfo
from splitserve.coordinator.registry import WorkerRegistry, record_of
from splitserve.discovery import Joined, Left, MembershipWatcher
from splitserve.proto.worker_clients import WorkerChannels

logger = logging.getLogger(__name__)

LOAD_INTERVAL_S = 0.5
RECONNECT_MIN_S = 0.2
RECONNECT_MAX_S = 5.0


class MembershipFollower:
    def __init__(
        self,
        watcher: MembershipWatcher,
        registry: WorkerRegistry,
        channels: WorkerChannels,
        on_leave: Callable[[str], None] = lambda worker_id: None,
        on_kv_events: Callable[[str, KvEvents], None] = lambda worker_id, events: None,
    ) -> None:
        """``on_leave``: called with each worker that left (the router forgets it);
        ``on_kv_events``: a worker's prefix-cache changes as its load stream brings them
        (the router's view of where KV lives)."""
        self._watcher = watcher
        self._registry = registry
        self._channels = channels
        self._on_leave = on_leave
        self._on_kv_events = on_kv_events
        self._following: dict[str, asyncio.Task[None]] = {}

    async def run(self) -> None:
        """Follow the membership until cancelled (``close`` stops the load streams); waits
        for the store to answer first (a coordinator may start before etcd)."""
        backoff_s = RECONNECT_MIN_S
        while True:
            try:
                await self._watcher.start()
                break
            except MembershipStoreError as error:
                logger.warning("membership store not readable yet (%s); retrying", error)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, RECONNECT_MAX_S)
        changes = self._watcher.changes()  # subscribed before the snapshot: nothing missed
        for info in self._watcher.snapshot().values():
            self._join(info)
        try:
            async for change in changes:
                match change:
                    case Joined(info):
                        self._join(info)
                    case Left(worker_id):
                        self._leave(worker_id)
        finally:
            await self.close()

    def _join(self, info: WorkerInfo) -> None:
        refusal = self._registry.refusal(info)  # a member serving another model, say
        if refusal is not None:
            logger.info("worker %s: not routed to here: %s", info.worker_id, refusal)
            self._leave(info.worker_id)  # should it have served this model before
            return
        logger.info("worker %s (%s) joined", info.worker_id, info.address)
        self._stop_following(info.worker_id)
        self._registry.register(record_of(info, dialled=False))  # its load stream dials it
        self._following[info.worker_id] = asyncio.create_task(
            self._follow_load(info), name=f"load-{info.worker_id}"
        )

    def _leave(self, worker_id: str) -> None:
        self._stop_following(worker_id)
        if self._registry.remove(worker_id) is not None:
            logger.info("worker %s left", worker_id)
        self._on_leave(worker_id)

    def _stop_following(self, worker_id: str) -> None:
        task = self._following.pop(worker_id, None)
        if task is not None:
            task.cancel()

    async def _follow_load(self, info: WorkerInfo) -> None:
        backoff_s = RECONNECT_MIN_S
        while True:
            try:
                watching = self._channels.monitor(info.address).watch_load(LOAD_INTERVAL_S)
                async for report in watching:
                    heard = (info.worker_id, report.load, report.ready, report.adapters)
                    if not self._registry.heartbeat(*heard):
                        self._registry.register(record_of(info))  # expired while silent
                        self._registry.heartbeat(*heard)
                    self._registry.mark_dialled(info.worker_id, info.address)
                    if report.kv_events is not None:
                        self._on_kv_events(info.worker_id, report.kv_events)
                    backoff_s = RECONNECT_MIN_S
            except SplitserveError as error:
                logger.warning("load stream of %s broke: %s", info.worker_id, error)
            self._registry.mark_failed(info.worker_id)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, RECONNECT_MAX_S)

    async def close(self) -> None:
        tasks = list(self._following.values())
        self._following.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._watcher.close()
