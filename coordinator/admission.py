"""Admission by KV: a request starts only when the cluster's decode KV can hold all it may grow
to; the rest wait in a bounded FIFO or are refused at once with a computed retry hint.

A request's demand is its prompt plus ``max_tokens``, rounded up to whole blocks
(``KvDemand.of``): what its decode worker's KV will hold at the end. (A remote-prefilled prompt
takes fresh blocks on the decode worker, prefix hits or not, so the figure is exact there.)
Capacity is the decode workers' KV in tokens times ``kv_share`` (``AdmissionConfig``): set it
to 1/N when N coordinators share the workers, so their admissions together stay within the
KV; left at 1, the decode workers' own ordered reservation queues absorb the overlap.

Decisions (``KvAdmission.admit``), in arrival order:
- nobody waits and the demand fits: admitted at once;
- the queue is full (requests or prompt tokens), or the predicted wait exceeds
  ``max_queue_wait_s``: refused at once with ``OverloadedError`` whose ``retry_after_s`` is
  the predicted wait;
- otherwise it waits; releases grant waiters oldest first while the oldest fits. One still
  waiting after ``max_queue_wait_s`` (the prediction was wrong) is refused then.

The predicted wait (``predicted_wait_s``) plays the queue forward: admitted requests end
after their output tokens left x the measured time per output token, queued ones start in
order as KV comes back and take the measured time to first token plus ``max_tokens`` x the
time per token (before any measurement: ``prior_ttft_s``, ``prior_tpot_s``). Requests that
stop early only make it shorter: it is an upper bound, the right side to err on for a retry
hint.

A demand larger than the whole capacity (only possible with ``kv_share`` < 1) is admitted
when it would run alone. Single event loop; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.common.errors import OverloadedError

SMOOTHING = 0.1
"""Weight of a new measurement in the running TTFT and TPOT estimates (exponential average)."""


@dataclass(frozen=True)
class AdmissionConfig:
    kv_share: float = 1.0
    """Share of the decode workers' KV this coordinator admits against (1/N for N)."""
    max_queued_requests: int = 256
    max_queued_prompt_tokens: int = 1 << 20
    max_queue_wait_s: float = 30.0
    """A request predicted to wait longer is refused at once; one waiting longer is refused."""
    prior_tpot_s: float = 0.05
    """Time per output token assumed until one is measured (the TPOT target is a fair one)."""
    prior_ttft_s: float = 1.0
    """Time from admission to first token assumed until one is measured."""


@dataclass(frozen=True)
class KvDemand:
    """KV a request may hold at its end, in tokens (whole blocks)."""

    num_tokens: int
    num_prompt_tokens: int
    max_tokens: int

    @classmethod
    def of(cls, num_prompt_tokens: int, max_tokens: int, block_size: int) -> KvDemand:
        blocks = math.ceil((num_prompt_tokens + max_tokens) / max(block_size, 1))
        return cls(blocks * max(block_size, 1), num_prompt_tokens, max_tokens)


@dataclass
class _Admitted:
    demand: KvDemand
    tokens_left: int
    admitted_at: float
    last_token_at: float | None = None


@dataclass
class _Waiter:
    request_id: str
    demand: KvDemand
    granted: asyncio.Future[None]


@dataclass(frozen=True)
class AdmissionSnapshot:
    """Figures for metrics: what is admitted and what waits."""

    capacity_tokens: int
    admitted_tokens: int
    num_admitted: int
    num_queued: int
    queued_prompt_tokens: int
    tpot_s: float
    ttft_s: float


class KvAdmission:
    """See the module docstring. ``capacity_tokens()``: the decode workers' KV in tokens
    (before ``kv_share``), read at every decision so joining and leaving workers count."""

    def __init__(
        self,
        config: AdmissionConfig,
        capacity_tokens: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._capacity_tokens = capacity_tokens
        self._clock = clock
        self._admitted: dict[str, _Admitted] = {}
        self._admitted_tokens = 0
        self._queue: deque[_Waiter] = deque()
        self._queued_prompt_tokens = 0
        self._tpot_s = config.prior_tpot_s
        self._ttft_s = config.prior_ttft_s
        self.refusals: dict[str, int] = {"queue_full": 0, "predicted_wait": 0, "waited_out": 0}
        """Refusals by reason, for metrics."""

    # ---- decisions ---------------------------------------------------------------------

    async def admit(self, request_id: str, demand: KvDemand) -> None:
        """Return once ``request_id`` is admitted; raises ``OverloadedError`` with the
        predicted wait as its retry hint when refused. Cancelled while waiting: it leaves the
        queue (granted in the same instant: admitted). Call ``release`` however this ended."""
        self._serve()  # capacity may have grown (a worker joined) since the last release
        if not self._queue and self._fits(demand):
            self._grant(request_id, demand)
            return
        wait_s = self.predicted_wait_s(demand)
        if self._queue_full(demand):
            self.refusals["queue_full"] += 1
            raise OverloadedError(
                f"{len(self._queue)} requests already wait for KV "
                f"(limit {self.config.max_queued_requests}, "
                f"{self._queued_prompt_tokens} prompt tokens)",
                retry_after_s=wait_s,
            )
        if wait_s > self.config.max_queue_wait_s:
            self.refusals["predicted_wait"] += 1
            raise OverloadedError(
                f"the KV this request needs ({demand.num_tokens} tokens) frees up in about "
                f"{wait_s:.1f} s, beyond the {self.config.max_queue_wait_s:g} s a request "
                "may wait",
                retry_after_s=wait_s,
            )
        waiter = _Waiter(request_id, demand, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        self._queued_prompt_tokens += demand.num_prompt_tokens
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), self.config.max_queue_wait_s)
        except TimeoutError:
            if waiter.granted.done():  # granted as the time ran out: admitted after all
                return
            self.refusals["waited_out"] += 1
            raise OverloadedError(
                f"waited {self.config.max_queue_wait_s:g} s for KV",
                retry_after_s=self.predicted_wait_s(demand),
            ) from None
        finally:
            if not waiter.granted.done():  # refused or cancelled: leave the queue
                waiter.granted.cancel()
                self._queue.remove(waiter)
                self._queued_prompt_tokens -= demand.num_prompt_tokens
                self._serve()  # the next one may fit now that it is the oldest

    def release(self, request_id: str) -> None:
        """The request ended (any way): its KV counts no more; waiters move up. Idempotent."""
        admitted = self._admitted.pop(request_id, None)
        if admitted is None:
            return
        self._admitted_tokens -= admitted.demand.num_tokens
        self._serve()

    def progress(self, request_id: str, num_new_tokens: int) -> None:
        """``num_new_tokens`` output tokens arrived for an admitted request: fewer left, and
        the time since its admission (first tokens) or its previous tokens updates the TTFT
        or the time-per-token estimate."""
        admitted = self._admitted.get(request_id)
        if admitted is None or num_new_tokens <= 0:
            return
        admitted.tokens_left = max(0, admitted.tokens_left - num_new_tokens)
        now = self._clock()
        previous, admitted.last_token_at = admitted.last_token_at, now
        if previous is None:  # its first tokens: the wait was TTFT
            self._ttft_s += SMOOTHING * (now - admitted.admitted_at - self._ttft_s)
        else:
            per_token = (now - previous) / num_new_tokens
            self._tpot_s += SMOOTHING * (per_token - self._tpot_s)

    # ---- figures -----------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return int(self._capacity_tokens() * self.config.kv_share)

    def predicted_wait_s(self, demand: KvDemand) -> float:
        """Seconds until ``demand`` could start behind everything queued; 0 when it fits now.

        Plays the queue forward: admitted requests end after their output tokens left x the
        time per token; each queued one, oldest first, starts once enough KV came back and
        then holds its demand for its first-token time plus ``max_tokens`` x time per token.
        """
        free = self.capacity_tokens - self._admitted_tokens
        ends = [
            (admitted.tokens_left * self._tpot_s, admitted.demand.num_tokens)
            for admitted in self._admitted.values()
        ]
        heapq.heapify(ends)
        now = 0.0
        for needed in [*(waiter.demand for waiter in self._queue), demand]:
            tokens = needed.num_tokens
            while free < tokens and ends:
                now, freed = heapq.heappop(ends)
                free += freed
            if free < tokens:  # larger than the capacity: it runs once all else ended
                free = max(free, tokens)
            free -= tokens
            duration = self._ttft_s + needed.max_tokens * self._tpot_s
            heapq.heappush(ends, (now + duration, tokens))
        return now

    def snapshot(self) -> AdmissionSnapshot:
        return AdmissionSnapshot(
            capacity_tokens=self.capacity_tokens,
            admitted_tokens=self._admitted_tokens,
            num_admitted=len(self._admitted),
            num_queued=len(self._queue),
            queued_prompt_tokens=self._queued_prompt_tokens,
            tpot_s=self._tpot_s,
            ttft_s=self._ttft_s,
        )

    # ---- internals ---------------------------------------------------------------------

    def _fits(self, demand: KvDemand) -> bool:
        if not self._admitted:  # alone, anything the workers accept may run
            return True
        return self._admitted_tokens + demand.num_tokens <= self.capacity_tokens

    def _queue_full(self, demand: KvDemand) -> bool:
        config = self.config
        return (
            len(self._queue) >= config.max_queued_requests
            or self._queued_prompt_tokens + demand.num_prompt_tokens
            > config.max_queued_prompt_tokens
        )

    def _grant(self, request_id: str, demand: KvDemand) -> None:
        self._admitted[request_id] = _Admitted(demand, demand.max_tokens, self._clock())
        self._admitted_tokens += demand.num_tokens

    def _serve(self) -> None:
        """Admit waiters, oldest first, while the oldest fits."""
        while self._queue and self._fits(self._queue[0].demand):
            waiter = self._queue.popleft()
            self._queued_prompt_tokens -= waiter.demand.num_prompt_tokens
            self._grant(waiter.request_id, waiter.demand)
            waiter.granted.set_result(None)
