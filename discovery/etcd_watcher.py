"""A coordinator's view of the workers in etcd: one read, then a prefix watch.

``EtcdMembershipWatcher.start`` reads every worker key of the cluster and watches the prefix
from the revision after that read, so no change falls between the two. Each watch event
updates the membership and is fanned out to every ``changes()`` iterator as ``Joined`` or
``Left``. The watch itself resumes after an etcd outage from the last revision it delivered
(``proto/etcd_client.py:EtcdClient.watch_prefix``), so an outage produces no change at all
and what changed meanwhile arrives once etcd is back. A value that is not a valid
``WorkerInfo`` for its key is logged and treated as no member.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from splitserve.common.errors import InvalidRequestError
from splitserve.common.membership import WorkerInfo
from splitserve.discovery import Joined, Left, MembershipChange
from splitserve.discovery.etcd_keys import worker_id_of, workers_prefix
from splitserve.proto import convert
from splitserve.proto.etcd_client import (
    DeleteEvent,
    EtcdClient,
    KeyValue,
    PutEvent,
    ResetEvent,
    WatchEvent,
)

logger = logging.getLogger(__name__)


class WatcherFailed(RuntimeError):
    """The watch ended on an error it cannot retry; the membership is no longer followed."""


class _Changes:
    """One subscriber's queue of changes, read as an async iterator; ``None`` ends it."""

    def __init__(self, watcher: EtcdMembershipWatcher) -> None:
        self._watcher = watcher
        self.queue: asyncio.Queue[MembershipChange | None] = asyncio.Queue()

    def __aiter__(self) -> _Changes:
        return self

    async def __anext__(self) -> MembershipChange:
        change = await self.queue.get()
        if change is None:
            self.queue.put_nowait(None)  # later calls end too
            if self._watcher.failure is not None:
                raise WatcherFailed("the etcd watch failed") from self._watcher.failure
            raise StopAsyncIteration
        return change


class EtcdMembershipWatcher:
    """``discovery.MembershipWatcher`` on etcd for the workers of ``cluster``."""

    def __init__(self, client: EtcdClient, cluster: str) -> None:
        self._client = client
        self._prefix = workers_prefix(cluster)
        self._members: dict[str, WorkerInfo] = {}
        self._subscribers: list[_Changes] = []
        self._task: asyncio.Task[None] | None = None
        self.failure: BaseException | None = None
        """What ended the watch, when an error did (``changes()`` iterators raise it)."""

    async def start(self) -> None:
        """Read the members and start following; raises ``EtcdError`` when etcd cannot be
        read (nothing is started then)."""
        if self._task is not None:
            raise RuntimeError("the watcher is already started")
        items, revision = await self._client.get_prefix(self._prefix)
        self._members = self._decode_all(items)
        self._task = asyncio.create_task(self._follow(revision + 1), name="etcd-membership")

    def snapshot(self) -> dict[str, WorkerInfo]:
        return dict(self._members)

    def changes(self) -> _Changes:
        """A new iterator of every change from now on (subscribed at this call, not at the
        first ``__anext__``)."""
        subscriber = _Changes(self)
        if self._task is not None and self._task.done():
            subscriber.queue.put_nowait(None)
        self._subscribers.append(subscriber)
        return subscriber

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._end_subscribers()

    async def _follow(self, start_revision: int) -> None:
        try:
            async for event in self._client.watch_prefix(self._prefix, start_revision):
                for change in self._apply(event):
                    for subscriber in self._subscribers:
                        subscriber.queue.put_nowait(change)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            logger.exception("the etcd membership watch failed")
            self.failure = error
        self._end_subscribers()

    def _end_subscribers(self) -> None:
        for subscriber in self._subscribers:
            subscriber.queue.put_nowait(None)
        self._subscribers.clear()

    def _apply(self, event: WatchEvent) -> list[MembershipChange]:
        """Update the members with ``event``; the changes it made, in order."""
        if isinstance(event, ResetEvent):
            return self._replace(self._decode_all(event.items))
        worker_id = worker_id_of(self._prefix, event.key)
        info = None
        if isinstance(event, PutEvent):
            info = self._decode(worker_id, event.value)
        elif not isinstance(event, DeleteEvent):
            raise TypeError(f"unknown watch event {event!r}")
        if info is None:
            if self._members.pop(worker_id, None) is None:
                return []
            return [Left(worker_id)]
        if self._members.get(worker_id) == info:
            return []  # re-published unchanged (a new lease after losing one)
        self._members[worker_id] = info
        return [Joined(info)]

    def _replace(self, members: dict[str, WorkerInfo]) -> list[MembershipChange]:
        old, self._members = self._members, members
        changes: list[MembershipChange] = [Left(wid) for wid in old if wid not in members]
        changes += [Joined(info) for wid, info in members.items() if old.get(wid) != info]
        return changes

    def _decode_all(self, items: Iterable[KeyValue]) -> dict[str, WorkerInfo]:
        members = {}
        for item in items:
            worker_id = worker_id_of(self._prefix, item.key)
            info = self._decode(worker_id, item.value)
            if info is not None:
                members[worker_id] = info
        return members

    def _decode(self, worker_id: str, value: bytes) -> WorkerInfo | None:
        try:
            info = convert.worker_info_from_bytes(value)
        except InvalidRequestError as error:
            logger.warning("ignoring etcd worker key %r: %s", worker_id, error)
            return None
        if info.worker_id != worker_id:
            logger.warning("ignoring etcd worker key %r: it holds %r", worker_id, info.worker_id)
            return None
        return info
