"""The requests that wait for admission, in two lanes: on time and late.

Every waiter is in the on-time lane, in admission order (``request_queue.py``: priority, fair
queuing across tenants, arrival), until it reaches the head while it can no longer have its
first token within its TTFT target (``move_late_heads``: admitted now, its prompt computed at
once at the cluster's prefill rate would end past its deadline). It then moves to the late
lane, keeping its ticket, and is served only after the on-time waiters of its priority or
lower (``next``). Why: ``admission.py``'s module docstring.

The on-time lane's queue also draws every arrival's ticket and keeps fair queuing's tags
(``ticket``, ``commit``, ``started``). Single event loop; no clock.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from splitserve.coordinator.kv_demand import KvDemand
from splitserve.coordinator.request_queue import FairRequestQueue, Ticket

AT_TAIL = (math.inf, math.inf, math.inf)
"""An order behind every waiter's (``demands_ahead_of``: all the on-time ones)."""


@dataclass(eq=False)
class Waiter:
    """A request in the queue, under its ticket (the queue keeps the order)."""

    request_id: str
    demand: KvDemand
    ticket: Ticket
    granted: asyncio.Future[None]
    enqueued_at: float
    predicted_wait_s: float
    ttft_deadline: float | None
    """When (the admission's clock) its first token is due; None: no deadline."""


class WaitQueue:
    """See the module docstring. Invariant: ``queued_prompt_tokens`` is the prompt tokens of
    the waiters in both lanes; a waiter is in one lane at a time."""

    def __init__(self) -> None:
        self._on_time: FairRequestQueue[Waiter] = FairRequestQueue()
        self._late: FairRequestQueue[Waiter] = FairRequestQueue()
        self.queued_prompt_tokens = 0
        self.late_waiters = 0
        """Waiters that moved to the late lane, ever (metrics)."""
        self.changes = 0
        """Counts every change of the on-time lane other than a waiter joining behind every
        other: what played the lane forward still holds while it stays the same."""

    def __len__(self) -> int:
        """Requests that wait, late or not."""
        return len(self._on_time) + len(self._late)

    def ticket(self, tenant: str, weight: float, cost: int, priority: int) -> Ticket:
        return self._on_time.ticket(tenant, weight, cost, priority)

    def commit(self, ticket: Ticket) -> None:
        self._on_time.commit(ticket)

    def started(self, ticket: Ticket) -> None:
        self._on_time.started(ticket)

    def add(self, waiter: Waiter) -> None:
        if not self.at_tail(waiter.ticket.order):
            self.changes += 1
        self._on_time.add(waiter.ticket, waiter)
        self.queued_prompt_tokens += waiter.demand.num_prompt_tokens

    def remove(self, waiter: Waiter) -> None:
        """Take a refused or cancelled ``waiter`` out of whichever lane holds it."""
        self.changes += 1
        try:
            self._on_time.remove(waiter)
        except ValueError:
            self._late.remove(waiter)
        self.queued_prompt_tokens -= waiter.demand.num_prompt_tokens

    def demands_ahead_of(self, order: tuple[int, float, int] | None) -> list[KvDemand]:
        """The demands of the on-time waiters before ``order``, in admission order (None:
        all waiters, the late ones last: they are behind a newcomer; ``AT_TAIL``: every
        on-time waiter)."""
        ahead = self._on_time.ahead_of(order)
        if order is None:
            ahead += self._late.ahead_of(None)
        return [waiter.demand for waiter in ahead]

    def at_tail(self, order: tuple[int, float, int]) -> bool:
        """Whether a waiter of ``order`` would join behind every on-time waiter (the late
        ones are behind a newcomer anyway). O(log waiters)."""
        return self._on_time.count_ahead_of(order) == len(self._on_time)

    def next(self, prefill_tokens_per_s: float, now: float, late_yield: bool) -> Waiter | None:
        """The waiter admitted next (None: nobody waits), after moving the late heads of the
        on-time lane (with ``late_yield``); each waiter moves once: O(1) amortised."""
        if late_yield and self._on_time:
            self._move_late_heads(prefill_tokens_per_s, now)
        if not self._late:
            return self._on_time.peek() if self._on_time else None
        if not self._on_time:
            return self._late.peek()
        on_time, late = self._on_time.peek(), self._late.peek()
        return on_time if on_time.ticket.order.rank <= late.ticket.order.rank else late

    def pop(self, waiter: Waiter) -> bool:
        """Take ``waiter``, the one ``next`` returned, out of its lane; True when it was on
        time (its wait is what the queue model predicted)."""
        on_time = bool(self._on_time) and self._on_time.peek() is waiter
        (self._on_time if on_time else self._late).pop()
        self.changes += on_time
        self.queued_prompt_tokens -= waiter.demand.num_prompt_tokens
        return on_time

    def _move_late_heads(self, prefill_tokens_per_s: float, now: float) -> None:
        if prefill_tokens_per_s <= 0:
            return
        while self._on_time:
            head = self._on_time.peek()
            soonest = now + head.demand.num_prompt_tokens / prefill_tokens_per_s
            if head.ttft_deadline is None or soonest <= head.ttft_deadline:
                return
            self._late.add(head.ticket, self._on_time.pop())
            self.late_waiters += 1
            self.changes += 1
