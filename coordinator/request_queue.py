"""The order in which waiting requests are admitted: higher priority first, then weighted fair
queuing across tenants, then arrival.

Weighted fair queuing: a request's start tag is the later of the virtual time and its
tenant's previous finish tag; its finish tag adds its cost (KV tokens) over its tenant's
weight; the virtual time is the start tag of the latest request admitted. A tenant that floods
the queue thus waits behind its own requests (their finish tags climb), not in front of
everyone else's, and a tenant of weight 3 gets three times the share of one of weight 1.

A request's place is a ``Ticket``: drawn at arrival (``ticket``), counted for its tenant once
the request is admitted or waits (``commit``: a refused request moves no tenant's tags), and
moving the virtual time once it is admitted (``started``). Only requests that wait enter the
queue (``add``); ``peek``/``pop`` give the next one in admission order.

Single event loop; nothing here blocks or reads a clock.
"""

from __future__ import annotations

import bisect
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")


class AdmissionOrder(NamedTuple):
    """Sorts in admission order (smaller first); a plain tuple of the same shape compares
    with it. Unique per ticket: ``arrival`` never repeats."""

    rank: int
    """Minus the priority: higher priority first."""
    finish_tag: float
    """Fair queuing's finish tag: the earlier first among equal priorities."""
    arrival: int
    """Arrival order: the earlier first among equal tags."""


@dataclass(frozen=True)
class Ticket:
    """A request's place in admission order, and what fair queuing needs of it later."""

    tenant: str
    start_tag: float
    """Where the tenant's share of the queue started for it (the virtual time moves here once
    it is admitted)."""
    order: AdmissionOrder


class RequestQueue(ABC, Generic[T]):
    """Requests that wait, each under the ``Ticket`` this queue issued it; ``peek``/``pop``
    give them in the order of their tickets. Tickets are drawn for every arriving request,
    waiting or not, so that the policy sees all that its tenants asked for."""

    @abstractmethod
    def ticket(self, tenant: str, weight: float, cost: int, priority: int) -> Ticket:
        """The place of a request of ``tenant`` (``weight``: its share, > 0; ``cost``: what it
        takes, in KV tokens) arriving now. Changes nothing a later ticket sees until
        ``commit``, but the arrival count."""

    @abstractmethod
    def commit(self, ticket: Ticket) -> None:
        """The request is admitted or waits: its tenant's later tickets come after it."""

    @abstractmethod
    def started(self, ticket: Ticket) -> None:
        """The request was admitted (at once or from the queue)."""

    @abstractmethod
    def add(self, ticket: Ticket, item: T) -> None:
        """``item`` waits under ``ticket`` (one the queue issued, not yet added)."""

    @abstractmethod
    def peek(self) -> T:
        """The next in admission order; ``IndexError`` when none waits."""

    @abstractmethod
    def pop(self) -> T:
        """Remove and return the next in admission order; ``IndexError`` when none waits."""

    @abstractmethod
    def remove(self, item: T) -> None:
        """Take ``item`` out wherever it is (refused or cancelled); ``ValueError`` if absent."""

    @abstractmethod
    def ahead_of(self, order: tuple[int, float, int] | None) -> list[T]:
        """Those that come before ``order``, in admission order (None: all of them)."""

    @abstractmethod
    def count_ahead_of(self, order: tuple[int, float, int]) -> int:
        """How many come before ``order`` (without listing them)."""

    @abstractmethod
    def __len__(self) -> int:
        """How many wait."""

    def __iter__(self) -> Iterator[T]:
        """All that wait, in admission order."""
        return iter(self.ahead_of(None))


class _Entry(NamedTuple, Generic[T]):
    order: AdmissionOrder
    item: T


def _order_of(entry: _Entry[T]) -> AdmissionOrder:
    return entry.order


class FairRequestQueue(RequestQueue[T]):
    """Priority, then weighted fair queuing across tenants, then arrival (module docstring).

    Invariants: ``_entries`` is sorted by order (orders are unique); ``_last_finish`` holds
    only tags later than the virtual time (an earlier one would start at the virtual time
    anyway), so it stays as small as the set of tenants recently served or waiting."""

    def __init__(self) -> None:
        self._entries: list[_Entry[T]] = []
        self._arrivals = itertools.count()
        self._virtual_time = 0.0
        """The start tag of the latest admitted request."""
        self._last_finish: dict[str, float] = {}
        """Per tenant: the finish tag of its latest committed request."""

    def ticket(self, tenant: str, weight: float, cost: int, priority: int) -> Ticket:
        start = max(self._virtual_time, self._last_finish.get(tenant, 0.0))
        finish = start + cost / weight
        return Ticket(tenant, start, AdmissionOrder(-priority, finish, next(self._arrivals)))

    def commit(self, ticket: Ticket) -> None:
        self._last_finish[ticket.tenant] = ticket.order.finish_tag

    def started(self, ticket: Ticket) -> None:
        self._virtual_time = max(self._virtual_time, ticket.start_tag)
        self._last_finish = {
            tenant: tag for tenant, tag in self._last_finish.items() if tag > self._virtual_time
        }

    def add(self, ticket: Ticket, item: T) -> None:
        bisect.insort(self._entries, _Entry(ticket.order, item), key=_order_of)

    def peek(self) -> T:
        return self._entries[0].item

    def pop(self) -> T:
        return self._entries.pop(0).item

    def remove(self, item: T) -> None:
        for index, entry in enumerate(self._entries):
            if entry.item is item:
                del self._entries[index]
                return
        raise ValueError("not in the queue")

    def count_ahead_of(self, order: tuple[int, float, int]) -> int:
        """How many entries come before ``order``. O(log entries)."""
        return bisect.bisect_left(self._entries, order, key=_order_of)

    def ahead_of(self, order: tuple[int, float, int] | None) -> list[T]:
        end = len(self._entries)
        if order is not None:
            end = bisect.bisect_left(self._entries, order, key=_order_of)
        return [entry.item for entry in self._entries[:end]]

    def __len__(self) -> int:
        return len(self._entries)
