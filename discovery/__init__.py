"""Cluster membership as a small interface with interchangeable backends (torch-free).

A worker publishes its ``WorkerInfo`` through an ``Announcer``; a coordinator follows who is
in the cluster through a ``MembershipWatcher``. Backends: ``etcd_announcer.py`` and
``etcd_watcher.py`` (etcd v3 leases and a prefix watch: any number of machines, no single
point of failure besides etcd's own quorum). Load figures are not membership: they travel on
their own stream, never through these interfaces.

Contracts every backend keeps:

- Announcer: ``announce(info)`` returns once ``info`` is visible to watchers and keeps it so
  (refreshing, re-publishing after losing it) until ``withdraw()``; ``withdraw()`` removes it
  at once, so every watcher reports ``Left`` without waiting for a timeout. A worker that
  dies without withdrawing is reported ``Left`` after the backend's time to live.
- MembershipWatcher: after ``start()``, ``snapshot()`` is the current membership and each
  iterator from ``changes()`` yields every later change once, in order: ``Joined`` for a new
  worker (or new info under a known id), ``Left`` for a gone one. Applying the changes to a
  snapshot taken with no ``await`` in between gives the next snapshot. While the backend is
  unreachable the membership stays as last known (no ``Left`` for an outage of the
  backend itself); on reconnection the watcher catches up with what changed meanwhile.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from splitserve.common.membership import WorkerInfo


@dataclass(frozen=True)
class Joined:
    """``info.worker_id`` is now a member with ``info`` (replacing any earlier info)."""

    info: WorkerInfo


@dataclass(frozen=True)
class Left:
    """``worker_id`` is no longer a member."""

    worker_id: str


MembershipChange = Joined | Left


class Announcer(Protocol):
    """A worker's side: publish its info, withdraw it when leaving."""

    async def announce(self, info: WorkerInfo) -> None:
        """Publish ``info`` and keep it published until ``withdraw()`` (once per
        announcer)."""
        ...

    async def withdraw(self) -> None:
        """Stop publishing and remove the info now; idempotent."""
        ...


class MembershipWatcher(Protocol):
    """A coordinator's side: the current members and the changes to them."""

    async def start(self) -> None:
        """Read the current membership and begin following changes."""
        ...

    def snapshot(self) -> dict[str, WorkerInfo]:
        """The members as last known, by worker id (a copy)."""
        ...

    def changes(self) -> AsyncIterator[MembershipChange]:
        """Every change from this call on; the iterator ends after ``close()``."""
        ...

    async def close(self) -> None:
        """Stop following; every ``changes()`` iterator ends."""
        ...
