"""Admission by KV and by tenant: a request starts only when the cluster's decode KV can hold
all it may grow to; the rest wait in a bounded, fairly ordered queue or are refused at once
with a computed retry hint.

A request's demand is its prompt plus ``max_tokens``, rounded up to whole blocks
(``kv_demand.py:KvDemand``): what its decode worker's KV will hold at the end. Capacity is the
decode workers' KV in tokens times ``kv_share`` (``AdmissionConfig``): set it to 1/N when N
coordinators share the workers, so their admissions together stay within the KV; left at 1,
the decode workers' own ordered reservation queues absorb the overlap.

``KvAdmission`` composes what it decides with:
- tenants first (``tenants.py`` for the limits, ``tenant_usage.py:TenantUsage`` for what each
  uses): a request over its tenant's requests in flight or tokens per minute is refused at once
  (``OverloadedError``, retry hint: when its tenant's soonest request is predicted to end, or
  when its bucket holds enough again); a priority above the tenant's ``max_priority`` or more
  tokens than its minute's budget is an ``InvalidRequestError``;
- the queue (``request_queue.py:FairRequestQueue``): higher priority first, then weighted fair
  queuing across tenants, then arrival;
- the estimates (``latency_estimator.py:LatencyEstimator``): measured TTFT, time per token and
  backlog drain rate, and the predicted wait that plays the queue forward (an upper bound).

Then the KV:
- nobody waits and the demand fits: admitted at once;
- the queue is full (requests or prompt tokens), or the predicted wait exceeds
  ``max_queue_wait_s`` (or the request's own bound, ``RequestRecord.max_queue_wait_s``):
  refused at once with ``OverloadedError`` whose ``retry_after_s`` is
  the predicted wait (for a full queue, the wait behind every waiter as computed at most
  ``RETRY_HINT_MAX_AGE_S`` ago: a crowd past the queue is refused in constant time each);
- otherwise it waits. Releases admit waiters in admission order while the next one fits
  (nobody overtakes it, so a large request is never starved), except that a waiter that can
  no longer have its first token within its TTFT target (``late_waiters_yield``: admitted
  now, its prompt computed at once at the whole cluster's prefill rate would still end past
  its deadline) moves behind those that still can, of its priority or lower, and is admitted
  once none of them waits or can be admitted. The test is that strict on purpose: a waiter
  called late that could have made it misses for certain (with the measured mean time from
  admission to first token instead, ~1 s, one that might have made it yielded: at the peak
  rate goodput came out lower on each of 3 seeds, 0.86x at the median, in one run). One let
  in waits for its turn even when the prediction was short, up
  to ``WAIT_BACKSTOP_FACTOR`` x ``max_queue_wait_s`` (then it is refused: its workers
  vanished, say); one that set its own bound waits that long at most.

Why late waiters yield: past the knee of the load, a queue served in arrival order makes
every request wait as long as the queue is, so every request misses its TTFT target once the
queue holds more than the target's worth of work, and goodput under the SLO falls to nothing
(chat at 2.5 req/s on the 2-core AMD EPYC, 2026-11-28: 0.11-0.43 req/s served within the SLO,
TTFT p50 4-11 s, where 1.5 req/s served 1.2-1.3). A request that will miss anyway loses
little by waiting longer; the ones behind it keep their targets.

Admitted prompts that have no first token yet form the prefill backlog; it is bounded too
(``prefill_backlog_s`` of the measured prefill rate of every worker that may compute prompts:
the prefill workers, and the decode workers where placement may put prompts there,
``Router.prompt_rates``; but it always lets in one prompt per such worker, so a prompt longer
than the bound does not leave all but one of them idle), so that what the workers
queue in arrival order stays short and waiting happens here, in fair order: a flood cannot put its
prompts in front of another tenant's in a worker's queue. (Counting the prefill workers alone
under adaptive placement, 0.5 s of one core's ~1,200 tokens/s let a second 340-token prompt
in only once the first had its first token: the prefill worker idled during each handoff,
and the decode core never got a prompt, as placement never saw a queue.)

A demand larger than the whole capacity (only possible with ``kv_share`` < 1) is admitted
when it would run alone. Single event loop; nothing here blocks. What a decision reads of
the admitted requests (their demand, average context, prompts in the backlog) is kept as
running sums, so admitting or refusing costs O(1) in them; only the predicted wait of a
request that may queue plays the queue and the admitted requests forward (O(N log N)), and
for one joining the queue's tail (a crowd of equals) the queue played forward is kept while
it only grows at its tail (``_tail_play``: O(log N) an arrival).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from splitserve.common.errors import OverloadedError
from splitserve.coordinator.admitted_requests import AdmittedRequest, AdmittedRequests
from splitserve.coordinator.kv_demand import KvDemand  # callers import it from here too
from splitserve.coordinator.latency_estimator import (
    KvOutlook,
    LatencyEstimator,
    QueuePlay,
    RunningEnd,
)
from splitserve.coordinator.request_queue import Ticket
from splitserve.coordinator.request_record import RequestRecord
from splitserve.coordinator.tenant_usage import TenantUsage
from splitserve.coordinator.tenants import TenantLimits, TenantPolicy
from splitserve.coordinator.wait_queue import AT_TAIL, Waiter, WaitQueue

RETRY_HINT_MAX_AGE_S = 0.1
"""A full queue's refusals reuse the wait behind the whole queue computed this recently."""
REFUSES_ALL_S = 0.1
"""A queue full by its request count refuses every arrival, whatever it asks, until a release
admits a waiter: its refusals say so for this long (``OverloadedError.refuses_all_s``), and a
multiplexing caller (the gateway) refuses its next streams itself meanwhile. A release in that
window may leave one queue place unused for its rest; the queue still holds work for every
worker."""
REFUSAL_REASONS = ("queue_full", "predicted_wait", "waited_out", "tenant_inflight", "tenant_tokens")
WAIT_BACKSTOP_FACTOR = 4.0
"""A queued request is refused only after this many times ``max_queue_wait_s``: the limit
decides at arrival, and one that was let in waits for its turn (refusing it after it waited
would waste the wait); the backstop covers workers that vanish with requests queued."""


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
    prefill_backlog_s: float = 0.5
    """Prompt tokens admitted and not yet prefilled (no first token) are bounded to this many
    seconds of the cluster's prefill rate; more wait here, in fair order, instead of in the
    workers' FIFO queues."""
    within_tpot: bool = False
    """Admit at most as many requests as the decode workers' learned step times let them
    decode within the TPOT target (``WorkerCapacity.max_decoding``); more wait or are
    refused. Off: the batch grows as long as the KV holds, and TPOT with it."""
    prior_prefill_tokens_per_s: float = 2000.0
    """Cluster prefill rate assumed until the workers report a measured one."""
    late_waiters_yield: bool = True
    """A waiter that can no longer meet its TTFT deadline lets those that still can go first
    (module docstring). Off: admission order only."""


@dataclass(frozen=True)
class WorkerCapacity:
    """What the workers' learned step times (``common/step_cost.py``) say they can do."""

    prefill_tokens_per_s: float | None = None
    """Prompt tokens per second of the workers that may compute prompts, together (None:
    none measured yet)."""
    max_decoding: int | None = None
    """Requests the decode workers can decode at once within the TPOT target, together
    (None: not learned yet: no bound)."""
    prompt_workers: int = 1
    """Workers that may compute prompts (whose rates ``prefill_tokens_per_s`` adds up): the
    prefill backlog always lets in one prompt per such worker, whatever its length."""


@dataclass(frozen=True)
class AdmissionOutcome:
    """One request's admission decision, as told to ``KvAdmission.outcome_listeners``."""

    tenant: str
    refused: str | None = None
    """The refusal's reason (``REFUSAL_REASONS``); None: admitted."""
    retry_after_s: float | None = None
    """The retry hint a refusal carried; None when admitted."""


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
    prefill_backlog_tokens: int
    prefill_drain_tokens_per_s: float | None
    """The backlog's measured drain rate (None: not measured; predictions use the workers'
    compute rate)."""


class KvAdmission:
    """See the module docstring. ``capacity_tokens()``: the decode workers' KV in tokens
    (before ``kv_share``); ``worker_capacity(context_tokens)``: what the workers' learned
    step times allow (``WorkerCapacity``) for requests of that many context tokens on
    average; both read at every decision, so joining and leaving workers count.

    Composed of: the admitted requests and their running sums (``admitted_requests.py``),
    the waiters in their two lanes (``wait_queue.py``), each tenant's use
    (``tenant_usage.py``) and the latency estimates (``latency_estimator.py``); what is
    decided here is only whether, and when, a request enters. Invariant: a request is
    admitted or waits, never both."""

    def __init__(
        self,
        config: AdmissionConfig,
        capacity_tokens: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
        tenants: TenantPolicy | None = None,
        worker_capacity: Callable[[int], WorkerCapacity] | None = None,
    ) -> None:
        self.config = config
        self.tenants = tenants or TenantPolicy()
        self._worker_capacity = worker_capacity or (lambda context_tokens: WorkerCapacity())
        self._capacity_tokens = capacity_tokens
        self._clock = clock
        self._usage = TenantUsage(clock)
        self._waiters = WaitQueue()
        self._latency = LatencyEstimator(config.prior_ttft_s, config.prior_tpot_s)
        self._admitted = AdmittedRequests()
        self._ends_cache: tuple[float, tuple[RunningEnd, ...]] | None = None
        """(when, ends) of the last ``_running_ends`` build."""
        self._tail_wait: tuple[float, float] | None = None
        self._play_cache: tuple[float, int, QueuePlay] | None = None
        """When the kept tail play was made, the wait queue's ``changes`` it holds, and it
        (``_tail_play``)."""
        """(when, seconds): the wait behind the whole queue last computed for a refusal."""
        self.refusals: dict[str, int] = dict.fromkeys(REFUSAL_REASONS, 0)
        """Refusals by reason, for metrics."""
        self.outcome_listeners: list[Callable[[AdmissionOutcome], None]] = []
        """Called with every admission and refusal as it is decided (metrics: per tenant,
        the retry hints' spread); on the event loop, so they must be quick."""

    @property
    def late_waiters(self) -> int:
        """Waiters that yielded to those still on time (``late_waiters_yield``), ever."""
        return self._waiters.late_waiters

    # ---- decisions ---------------------------------------------------------------------

    async def admit(self, request: RequestRecord, demand: KvDemand) -> None:
        """Return once ``request`` (its KV ``demand``) is admitted; raises
        ``OverloadedError`` with a computed retry hint when refused (the KV queue, or the
        tenant's limits), and ``InvalidRequestError`` for what the tenant may never ask (a
        priority above its ``max_priority``, more tokens than its minute's budget).
        Cancelled while waiting: it leaves the queue (granted in the same instant:
        admitted). Call ``release`` however this ended (a refused request is not admitted: a
        no-op). Its TTFT deadline (``RequestRecord.ttft_deadline``) is on this admission's
        clock."""
        tenant = request.tenant
        limits = self.tenants.limits(tenant)
        self._check_tenant(tenant, limits, demand, request.priority)
        self._serve()  # capacity may have grown (a worker joined) since the last release
        ticket = self._waiters.ticket(tenant, limits.weight, demand.num_tokens, request.priority)
        if not self._waiters and self._fits(demand):
            self._enter(ticket)
            self._grant(request.request_id, demand, ticket)
            return
        limit_s = request.max_queue_wait_s or self.config.max_queue_wait_s
        wait_s = self._wait_or_refuse(demand, ticket, limit_s)
        self._enter(ticket)
        granted = asyncio.get_running_loop().create_future()
        deadline = request.ttft_deadline
        waiter = Waiter(
            request.request_id,
            demand,
            ticket,
            granted,
            self._clock(),
            wait_s,
            deadline if math.isfinite(deadline) else None,
        )
        self._waiters.add(waiter)
        self._joined(demand)
        try:  # a bound the request set itself is a bound on its wait, not a prediction's
            backstop_s = limit_s if request.max_queue_wait_s else limit_s * WAIT_BACKSTOP_FACTOR
            await self._wait_for_turn(waiter, backstop_s)
        finally:
            if not granted.done():  # refused or cancelled: leave the queue
                granted.cancel()
                self._waiters.remove(waiter)
                self._usage.leave(tenant, 0)  # its tokens are taken only when it is granted
                self._serve()  # the next one may fit now that it is the oldest

    def _wait_or_refuse(self, demand: KvDemand, ticket: Ticket, limit_s: float) -> float:
        """The predicted wait of a request that cannot start now; refuses it
        (``OverloadedError``) when the queue is full or the wait is beyond ``limit_s`` (the
        request's own bound, else ``max_queue_wait_s``)."""
        if self._queue_full(demand):
            self._refuse(
                ticket.tenant,
                "queue_full",
                f"{len(self._waiters)} requests already wait for KV "
                f"(limit {self.config.max_queued_requests}, "
                f"{self._waiters.queued_prompt_tokens} prompt tokens)",
                self._wait_behind_queue_s(demand),
                REFUSES_ALL_S if self._queue_full_by_count() else 0.0,
            )
        wait_s = self.predicted_wait_s(demand, ticket.order)
        if wait_s > limit_s:
            self._refuse(
                ticket.tenant,
                "predicted_wait",
                f"the KV this request needs ({demand.num_tokens} tokens) frees up in about "
                f"{wait_s:.1f} s, beyond the {limit_s:g} s it may wait",
                wait_s,
            )
        return wait_s

    async def _wait_for_turn(self, waiter: Waiter, backstop_s: float) -> None:
        """Wait until ``_serve`` grants ``waiter``; refused (``waited_out``) after
        ``backstop_s``."""
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), backstop_s)
        except TimeoutError:
            if waiter.granted.done():  # granted as the time ran out: admitted after all
                return
            self._refuse(
                waiter.ticket.tenant,
                "waited_out",
                f"waited {backstop_s:g} s for KV",
                self.predicted_wait_s(waiter.demand, waiter.ticket.order),
            )

    def _wait_behind_queue_s(self, demand: KvDemand) -> float:
        """The predicted wait behind every waiter, reused for ``RETRY_HINT_MAX_AGE_S``."""
        now = self._clock()
        if self._tail_wait is None or now - self._tail_wait[0] > RETRY_HINT_MAX_AGE_S:
            self._tail_wait = (now, self.predicted_wait_s(demand))
        return self._tail_wait[1]

    def release(self, request_id: str) -> None:
        """The request ended (any way): its KV counts no more, the output it did not
        generate goes back to its tenant's budget, waiters move up. Idempotent."""
        admitted = self._admitted.remove(request_id)
        if admitted is None:
            return
        if admitted.last_token_at is None:  # ended before its first token
            self._latency.backlog_changed(self._clock(), self._admitted.backlog_prompts)
        self._usage.leave(admitted.tenant, admitted.tokens_left)
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
        if previous is None:  # its first tokens: the wait was TTFT, its prompt is done
            self._admitted.first_tokens(admitted)
            self._latency.first_token(now - admitted.admitted_at)
            num_prompt_tokens = admitted.demand.num_prompt_tokens
            backlog_prompts = self._admitted.backlog_prompts
            self._latency.prompt_prefilled(num_prompt_tokens, now, backlog_prompts)
            self._serve()
        else:
            self._latency.output_tokens(num_new_tokens, now - previous)

    # ---- figures -----------------------------------------------------------------------

    @property
    def average_context_tokens(self) -> float:
        """The admitted requests' average context over their lives (prompt + half their
        ``max_tokens``); 0 with none admitted."""
        count = len(self._admitted)
        return self._admitted.context_sum / count if count else 0.0

    @property
    def capacity_tokens(self) -> int:
        return int(self._capacity_tokens() * self.config.kv_share)

    def predicted_wait_s(
        self, demand: KvDemand, sort_key: tuple[int, float, int] | None = None
    ) -> float:
        """Seconds until ``demand`` could start behind the waiters admitted before it
        (``sort_key``: its ``request_queue.py:AdmissionOrder``; None: behind all); 0 when it
        fits now. See ``LatencyEstimator.predicted_wait_s``. Late waiters
        (``late_waiters_yield``) are behind a newcomer, so only behind all are they counted."""
        if sort_key is not None and self._waiters.at_tail(sort_key):
            return self._tail_play(demand).start_s(demand)
        ahead = self._waiters.demands_ahead_of(sort_key)
        return self._latency.predicted_wait_s(self._outlook(demand), [*ahead, demand])

    def _tail_play(self, demand: KvDemand) -> QueuePlay:
        """The on-time waiters played forward (``latency_estimator.py:QueuePlay``), for a
        newcomer that joins behind them all: kept while the lane changes only by waiters
        joining at its tail (each played as it joins, ``_joined``), for at most
        ``RETRY_HINT_MAX_AGE_S`` (the admitted requests' ends in it are as old as
        ``_running_ends``' may be); with ``within_tpot`` (decode slots that depend on the
        demand) it is made for each newcomer. A crowd that queues then costs O(log queue)
        an arrival, not O(queue)."""
        now = self._clock()
        cached = self._play_cache
        changes = self._waiters.changes
        if cached is not None and now - cached[0] <= RETRY_HINT_MAX_AGE_S and cached[1] == changes:
            return cached[2]
        play = self._latency.play(self._outlook(demand))
        for ahead in self._waiters.demands_ahead_of(AT_TAIL):
            play.append(ahead)
        self._play_cache = None if self.config.within_tpot else (now, changes, play)
        return play

    def _joined(self, demand: KvDemand) -> None:
        """A waiter of ``demand`` joined the on-time lane: the kept tail play takes it where
        it joined at the tail (the lane's ``changes`` did not move)."""
        cached = self._play_cache
        if cached is not None and cached[1] == self._waiters.changes:
            cached[2].append(demand)

    def _running_ends(self) -> tuple[RunningEnd, ...]:
        """Every admitted request's predicted end, sorted: built at most once per
        ``RETRY_HINT_MAX_AGE_S`` (each arrival of a crowd that waits or is refused reads it;
        rebuilding it for each cost O(admitted) of Python apiece, a fifth of a coordinator's
        time at 5,000 streams). Until the next build the ends are as of the last: requests
        admitted, released or advanced since are not in them, which moves a prediction (a
        wait the admission bounds, a retry hint) by about that much churn."""
        now = self._clock()
        cached = self._ends_cache
        if cached is not None and now - cached[0] <= RETRY_HINT_MAX_AGE_S:
            return cached[1]
        ends = tuple(
            sorted(
                RunningEnd(self._time_left_s(admitted), admitted.demand.num_tokens)
                for admitted in self._admitted.all()
            )
        )
        self._ends_cache = (now, ends)
        return ends

    def _outlook(self, demand: KvDemand) -> KvOutlook:
        """What is admitted now, as the wait prediction for ``demand`` sees it."""
        free_tokens = self.capacity_tokens - self._admitted.kv_tokens
        slots = self._max_decoding(demand)
        running = self._running_ends()
        prefill_tokens_per_s = self.prefill_tokens_per_s
        return KvOutlook(
            free_tokens=free_tokens,
            free_slots=math.inf if slots is None else slots - len(self._admitted),
            running=running,
            backlog_tokens=self._admitted.backlog_tokens,
            backlog_limit_tokens=self._backlog_limit(prefill_tokens_per_s),
            prefill_tokens_per_s=prefill_tokens_per_s,
        )

    def _time_left_s(self, admitted: AdmittedRequest) -> float:
        """When an admitted request is predicted to end."""
        waited_s = None
        if admitted.last_token_at is None:
            waited_s = self._clock() - admitted.admitted_at
        return self._latency.time_left_s(admitted.tokens_left, waited_s)

    @property
    def prefill_tokens_per_s(self) -> float:
        """The workers' learned prefill rate, or the configured prior."""
        measured = self._worker_capacity(0).prefill_tokens_per_s
        return measured if measured else self.config.prior_prefill_tokens_per_s

    def _max_decoding(self, demand: KvDemand) -> int | None:
        """Requests that may be admitted at once for the decode workers to keep the TPOT
        target, at the average context of what is admitted plus ``demand`` (None: no
        bound known yet). Never below 1."""
        average = self._admitted.average_context_with(demand)
        bound = self._worker_capacity(round(average)).max_decoding
        return None if bound is None else max(1, bound)

    def snapshot(self) -> AdmissionSnapshot:
        return AdmissionSnapshot(
            capacity_tokens=self.capacity_tokens,
            admitted_tokens=self._admitted.kv_tokens,
            num_admitted=len(self._admitted),
            num_queued=len(self._waiters),
            queued_prompt_tokens=self._waiters.queued_prompt_tokens,
            tpot_s=self._latency.tpot_s,
            ttft_s=self._latency.ttft_s,
            prefill_backlog_tokens=self._admitted.backlog_tokens,
            prefill_drain_tokens_per_s=self._latency.drain_tokens_per_s,
        )

    # ---- tenants -----------------------------------------------------------------------

    def _check_tenant(
        self, tenant: str, limits: TenantLimits, demand: KvDemand, priority: int
    ) -> None:
        """Refuse what the tenant may not ask now (``OverloadedError``) or ever
        (``InvalidRequestError``); takes nothing."""
        refusal = self._usage.check(
            tenant,
            limits,
            demand.num_prompt_tokens + demand.max_tokens,
            priority,
            lambda: self._tenant_turn_s(tenant, demand),
        )
        if refusal is not None:
            self._refuse(tenant, refusal.reason, refusal.message, refusal.retry_after_s)

    def _tenant_turn_s(self, tenant: str, demand: KvDemand) -> float:
        """When the tenant's soonest-ending request is predicted to end."""
        ends = [
            self._time_left_s(admitted)
            for admitted in self._admitted.all()
            if admitted.tenant == tenant
        ]
        return min(ends, default=self._latency.run_time_s(demand.max_tokens))

    def _enter(self, ticket: Ticket) -> None:
        """A request is admitted or waits: it counts in its tenant's requests in flight, and
        the tenant's next request queues behind it."""
        self._waiters.commit(ticket)
        self._usage.enter(ticket.tenant)

    def _refuse(
        self,
        tenant: str,
        reason: str,
        message: str,
        retry_after_s: float,
        refuses_all_s: float = 0.0,
    ) -> NoReturn:
        self.refusals[reason] += 1
        self._tell(AdmissionOutcome(tenant, reason, retry_after_s))
        raise OverloadedError(message, retry_after_s, refuses_all_s)

    def _tell(self, outcome: AdmissionOutcome) -> None:
        for listener in self.outcome_listeners:
            listener(outcome)

    # ---- the KV and the prefill backlog ------------------------------------------------

    def _fits(self, demand: KvDemand) -> bool:
        """Room in the KV, in the decode batch the TPOT target allows and in the prefill
        backlog (alone, anything the workers accept)."""
        admitted = self._admitted
        if not len(admitted):
            return True
        if admitted.kv_tokens + demand.num_tokens > self.capacity_tokens:
            return False
        slots = self._max_decoding(demand)
        if slots is not None and len(admitted) >= slots:
            return False
        return (
            admitted.backlog_prompts < self._worker_capacity(0).prompt_workers
            or admitted.backlog_tokens + demand.num_prompt_tokens <= self.prefill_backlog_limit
        )

    @property
    def prefill_backlog_limit(self) -> int:
        """Prompt tokens the backlog may hold: ``prefill_backlog_s`` of prefill."""
        return self._backlog_limit(self.prefill_tokens_per_s)

    def _backlog_limit(self, prefill_tokens_per_s: float) -> int:
        return int(self.config.prefill_backlog_s * prefill_tokens_per_s)

    def _queue_full(self, demand: KvDemand) -> bool:
        return (
            self._queue_full_by_count()
            or self._waiters.queued_prompt_tokens + demand.num_prompt_tokens
            > self.config.max_queued_prompt_tokens
        )

    def _queue_full_by_count(self) -> bool:
        """The queue refuses any request, whatever its prompt (``REFUSES_ALL_S``)."""
        return len(self._waiters) >= self.config.max_queued_requests

    def _grant(self, request_id: str, demand: KvDemand, ticket: Ticket) -> None:
        """Admit: its KV counts, its tenant's tokens are taken, the virtual time moves on."""
        now = self._clock()
        self._admitted.add(request_id, demand, ticket.tenant, now)
        self._latency.backlog_changed(now, self._admitted.backlog_prompts)
        self._usage.take(ticket.tenant, demand.num_prompt_tokens + demand.max_tokens)
        self._waiters.started(ticket)
        self._tell(AdmissionOutcome(ticket.tenant))

    def _serve(self) -> None:
        """Admit waiters while the next one fits: in admission order, late ones after those
        of their priority that are not (``wait_queue.py``)."""
        late_yield = self.config.late_waiters_yield
        while self._waiters:
            waiter = self._waiters.next(self.prefill_tokens_per_s, self._clock(), late_yield)
            if waiter is None or not self._fits(waiter.demand):
                return
            on_time = self._waiters.pop(waiter)
            self._grant(waiter.request_id, waiter.demand, waiter.ticket)
            waiter.granted.set_result(None)
            if on_time:  # a late one's wait is not what the queue model predicts
                self._latency.waited(self._clock() - waiter.enqueued_at, waiter.predicted_wait_s)
