"""Admission by KV and by tenant: a request starts only when the cluster's decode KV can hold
all it may grow to; the rest wait in a bounded, fairly ordered queue or are refused at once
with a computed retry hint.

A request's demand is its prompt plus ``max_tokens``, rounded up to whole blocks
(``KvDemand.of``): what its decode worker's KV will hold at the end. (A remote-prefilled prompt
takes fresh blocks on the decode worker, prefix hits or not, so the figure is exact there.)
Capacity is the decode workers' KV in tokens times ``kv_share`` (``AdmissionConfig``): set it
to 1/N when N coordinators share the workers, so their admissions together stay within the
KV; left at 1, the decode workers' own ordered reservation queues absorb the overlap.

Tenants first (``tenants.py``: a tenant per API key): a request over its tenant's requests in
flight or tokens per minute is refused at once (``OverloadedError``, retry hint: when its
tenant's soonest request is predicted to end, or when its bucket holds enough again); a
priority above the tenant's ``max_priority`` or more tokens than its minute's budget is an
``InvalidRequestError``. Then the KV:
- nobody waits and the demand fits: admitted at once;
- the queue is full (requests or prompt tokens), or the predicted wait exceeds
  ``max_queue_wait_s``: refused at once with ``OverloadedError`` whose ``retry_after_s`` is
  the predicted wait;
- otherwise it waits. Releases admit waiters in admission order while the next one fits
  (nobody overtakes it, so a large request is never starved): higher priority first, then
  weighted fair queuing across tenants (each request's finish tag is its tenant's previous
  tag, or the virtual time if later, plus its KV over the tenant's weight), so a tenant that
  floods the queue waits behind its own requests, not in front of everyone else's. One let in
  waits for its turn even when the prediction was short, up to ``WAIT_BACKSTOP_FACTOR`` x
  ``max_queue_wait_s`` (then it is refused: its workers vanished, say).

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

The predicted wait (``predicted_wait_s``) plays the queue forward: admitted requests end
after what is left of their time to first token, then their output tokens left x the
measured time per output token, queued ones start in
order as KV comes back and the prefill backlog (drained at the workers' measured prefill
rate) has room, and take the measured time to first token plus ``max_tokens`` x the time per
token (before any measurement: ``prior_ttft_s``, ``prior_tpot_s``,
``prior_prefill_tokens_per_s``). Requests that
stop early only make it shorter: it is an upper bound, the right side to err on for a retry
hint.

A demand larger than the whole capacity (only possible with ``kv_share`` < 1) is admitted
when it would run alone. Single event loop; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

from splitserve.common.errors import InvalidRequestError, OverloadedError
from splitserve.coordinator.tenants import TenantLimits, TenantPolicy, TokenBucket

REFUSAL_REASONS = ("queue_full", "predicted_wait", "waited_out", "tenant_inflight", "tenant_tokens")
WAIT_BACKSTOP_FACTOR = 4.0
"""A queued request is refused only after this many times ``max_queue_wait_s``: the limit
decides at arrival, and one that was let in waits for its turn (refusing it after it waited
would waste the wait); the backstop covers workers that vanish with requests queued."""
SMOOTHING = 0.1
CALIBRATION_MIN_WAIT_S = 0.5
"""Waits predicted shorter than this do not calibrate (noise dominates them)."""
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


@dataclass
class _Admitted:
    demand: KvDemand
    tenant: str
    tokens_left: int
    admitted_at: float
    last_token_at: float | None = None
    """None until its first tokens: until then its prompt counts in the prefill backlog."""


@dataclass(order=True)
class _Waiter:
    """Ordered by admission order: priority first, then the fair-queuing finish tag."""

    sort_key: tuple[int, float, int]
    request_id: str = field(compare=False)
    demand: KvDemand = field(compare=False)
    tenant: str = field(compare=False)
    start_tag: float = field(compare=False)
    granted: asyncio.Future[None] = field(compare=False)
    enqueued_at: float = field(compare=False, default=0.0)
    predicted_wait_s: float = field(compare=False, default=0.0)


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


class KvAdmission:
    """See the module docstring. ``capacity_tokens()``: the decode workers' KV in tokens
    (before ``kv_share``); ``worker_capacity(context_tokens)``: what the workers' learned
    step times allow (``WorkerCapacity``) for requests of that many context tokens on
    average; both read at every decision, so joining and leaving workers count."""

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
        self._wait_calibration = 1.0
        """Measured waits over predicted ones (smoothed); predictions are scaled by it when
        above 1, so that a model that runs optimistic refuses at once rather than after a
        request waited out its limit."""
        self._drain_tokens_per_s: float | None = None
        """Measured: prompt tokens per second leaving the backlog while it is not empty."""
        self._backlog_busy_since: float | None = None
        """When the backlog last became non-empty, or its last prompt completed."""
        self._prefill_backlog = 0
        """Prompt tokens of admitted requests without a first token yet."""
        self._capacity_tokens = capacity_tokens
        self._clock = clock
        self._admitted: dict[str, _Admitted] = {}
        self._admitted_tokens = 0
        self._queue: list[_Waiter] = []
        """Unsorted; the next one is ``min(self._queue)`` (a few hundred at most)."""
        self._queued_prompt_tokens = 0
        self._tpot_s = config.prior_tpot_s
        self._ttft_s = config.prior_ttft_s
        self._sequence = itertools.count()
        self._virtual_time = 0.0
        """Fair queuing's clock: the start tag of the latest admitted request."""
        self._last_finish: dict[str, float] = {}
        """Per tenant: the finish tag of its latest request (pruned once in the past)."""
        self._inflight: dict[str, int] = {}
        """Per tenant: requests admitted or waiting (absent: none)."""
        self._buckets: dict[str, TokenBucket] = {}
        self.refusals: dict[str, int] = dict.fromkeys(REFUSAL_REASONS, 0)
        """Refusals by reason, for metrics."""

    # ---- decisions ---------------------------------------------------------------------

    async def admit(
        self, request_id: str, demand: KvDemand, tenant: str = "", priority: int = 0
    ) -> None:
        """Return once ``request_id`` is admitted; raises ``OverloadedError`` with a computed
        retry hint when refused (the KV queue, or the tenant's limits), and
        ``InvalidRequestError`` for what the tenant may never ask (a priority above its
        ``max_priority``, more tokens than its minute's budget). Cancelled while waiting: it
        leaves the queue (granted in the same instant: admitted). Call ``release`` however
        this ended (a refused request is not admitted: a no-op)."""
        limits = self.tenants.limits(tenant)
        self._check_tenant(tenant, limits, demand, priority)
        self._serve()  # capacity may have grown (a worker joined) since the last release
        start_tag, sort_key = self._tags(tenant, limits, demand, priority)
        if not self._queue and self._fits(demand):
            self._enter(tenant, sort_key)
            self._grant(request_id, tenant, demand, start_tag)
            return
        wait_s = self.predicted_wait_s(demand, sort_key)
        if self._queue_full(demand):
            self._refuse(
                "queue_full",
                f"{len(self._queue)} requests already wait for KV "
                f"(limit {self.config.max_queued_requests}, "
                f"{self._queued_prompt_tokens} prompt tokens)",
                wait_s,
            )
        if wait_s > self.config.max_queue_wait_s:
            self._refuse(
                "predicted_wait",
                f"the KV this request needs ({demand.num_tokens} tokens) frees up in about "
                f"{wait_s:.1f} s, beyond the {self.config.max_queue_wait_s:g} s a request "
                "may wait",
                wait_s,
            )
        self._enter(tenant, sort_key)
        granted = asyncio.get_running_loop().create_future()
        waiter = _Waiter(
            sort_key, request_id, demand, tenant, start_tag, granted, self._clock(), wait_s
        )
        self._queue.append(waiter)
        self._queued_prompt_tokens += demand.num_prompt_tokens
        try:
            backstop_s = self.config.max_queue_wait_s * WAIT_BACKSTOP_FACTOR
            await asyncio.wait_for(asyncio.shield(granted), backstop_s)
        except TimeoutError:
            if granted.done():  # granted as the time ran out: admitted after all
                return
            self._refuse(
                "waited_out",
                f"waited {backstop_s:g} s for KV",
                self.predicted_wait_s(demand, sort_key),
            )
        finally:
            if not granted.done():  # refused or cancelled: leave the queue
                granted.cancel()
                self._queue.remove(waiter)
                self._queued_prompt_tokens -= demand.num_prompt_tokens
                self._leave(tenant, 0)  # its tokens are taken only when it is granted
                self._serve()  # the next one may fit now that it is the oldest

    def release(self, request_id: str) -> None:
        """The request ended (any way): its KV counts no more, the output it did not
        generate goes back to its tenant's budget, waiters move up. Idempotent."""
        admitted = self._admitted.pop(request_id, None)
        if admitted is None:
            return
        self._admitted_tokens -= admitted.demand.num_tokens
        if admitted.last_token_at is None:  # ended before its first token
            self._prefill_backlog -= admitted.demand.num_prompt_tokens
            if self._prefill_backlog == 0:
                self._backlog_busy_since = None
        self._leave(admitted.tenant, admitted.tokens_left)
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
            self._ttft_s += SMOOTHING * (now - admitted.admitted_at - self._ttft_s)
            self._drained(admitted.demand.num_prompt_tokens, now)
            self._serve()
        else:
            per_token = (now - previous) / num_new_tokens
            self._tpot_s += SMOOTHING * (per_token - self._tpot_s)

    def _drained(self, num_prompt_tokens: int, now: float) -> None:
        """A prompt left the backlog: measure how fast the backlog drains while busy."""
        self._prefill_backlog -= num_prompt_tokens
        busy_since = self._backlog_busy_since
        if busy_since is not None and now > busy_since:
            rate = num_prompt_tokens / (now - busy_since)
            previous = self._drain_tokens_per_s
            self._drain_tokens_per_s = (
                rate if previous is None else previous + SMOOTHING * (rate - previous)
            )
        self._backlog_busy_since = now if self._prefill_backlog > 0 else None

    # ---- figures -----------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return int(self._capacity_tokens() * self.config.kv_share)

    def predicted_wait_s(
        self, demand: KvDemand, sort_key: tuple[int, float, int] | None = None
    ) -> float:
        """Seconds until ``demand`` could start behind the waiters admitted before it
        (``sort_key``; None: behind all); 0 when it fits now.

        Plays the queue forward: admitted requests end after their output tokens left x the
        time per token; each waiter ahead, in admission order, starts once enough KV came
        back and then holds its demand for its first-token time plus ``max_tokens`` x time
        per token. Scaled by how far past predictions fell short, when they did.
        """
        ahead = sorted(w for w in self._queue if sort_key is None or w.sort_key < sort_key)
        free = self.capacity_tokens - self._admitted_tokens
        slots = self._max_decoding(demand)
        free_slots = math.inf if slots is None else slots - len(self._admitted)
        ends = [
            (self._time_left_s(admitted), admitted.demand.num_tokens)
            for admitted in self._admitted.values()
        ]
        heapq.heapify(ends)
        # the backlog drains as fast as it was seen to (compute rate until measured)
        rate = self._drain_tokens_per_s or self.prefill_tokens_per_s
        prefilled_at = self._prefill_backlog / rate  # when the admitted prompts are done
        window_s = self.prefill_backlog_limit / rate
        now = 0.0
        for needed in [*(waiter.demand for waiter in ahead), demand]:
            tokens = needed.num_tokens
            while (free < tokens or free_slots < 1) and ends:
                now, freed = heapq.heappop(ends)
                free += freed
                free_slots += 1
            if free < tokens:  # larger than the capacity: it runs once all else ended
                free = max(free, tokens)
            free -= tokens
            free_slots -= 1
            prompt_s = needed.num_prompt_tokens / rate
            now = max(now, prefilled_at + prompt_s - window_s)  # the backlog keeps its bound
            prefilled_at = max(prefilled_at, now) + prompt_s
            duration = self._ttft_s + needed.max_tokens * self._tpot_s
            heapq.heappush(ends, (now + duration, tokens))
        return now * max(1.0, self._wait_calibration)

    def _time_left_s(self, admitted: _Admitted) -> float:
        """When an admitted request is predicted to end: its output tokens left x the time
        per token, after what is left of its first-token time if it has none yet."""
        decode_s = admitted.tokens_left * self._tpot_s
        if admitted.last_token_at is not None:
            return decode_s
        waited_s = self._clock() - admitted.admitted_at
        return max(0.0, self._ttft_s - waited_s) + decode_s

    @property
    def prefill_tokens_per_s(self) -> float:
        """The workers' learned prefill rate, or the configured prior."""
        measured = self._worker_capacity(0).prefill_tokens_per_s
        return measured if measured else self.config.prior_prefill_tokens_per_s

    def _max_decoding(self, demand: KvDemand) -> int | None:
        """Requests that may be admitted at once for the decode workers to keep the TPOT
        target, at the average context of what is admitted plus ``demand`` (None: no
        bound known yet). Never below 1."""
        contexts = [
            a.demand.num_prompt_tokens + a.demand.max_tokens / 2 for a in self._admitted.values()
        ]
        contexts.append(demand.num_prompt_tokens + demand.max_tokens / 2)
        bound = self._worker_capacity(round(sum(contexts) / len(contexts))).max_decoding
        return None if bound is None else max(1, bound)

    def snapshot(self) -> AdmissionSnapshot:
        return AdmissionSnapshot(
            capacity_tokens=self.capacity_tokens,
            admitted_tokens=self._admitted_tokens,
            num_admitted=len(self._admitted),
            num_queued=len(self._queue),
            queued_prompt_tokens=self._queued_prompt_tokens,
            tpot_s=self._tpot_s,
            ttft_s=self._ttft_s,
            prefill_backlog_tokens=self._prefill_backlog,
        )

    # ---- tenants -----------------------------------------------------------------------

    def _check_tenant(
        self, tenant: str, limits: TenantLimits, demand: KvDemand, priority: int
    ) -> None:
        """Refuse what the tenant may not ask now (``OverloadedError``) or ever
        (``InvalidRequestError``); takes nothing."""
        if priority > limits.max_priority:
            raise InvalidRequestError(
                f"priority {priority} is above this key's highest, {limits.max_priority}",
                "priority",
            )
        inflight = self._inflight.get(tenant, 0)
        if limits.max_inflight and inflight >= limits.max_inflight:
            self._refuse(
                "tenant_inflight",
                f"this key has {inflight} requests in flight (limit {limits.max_inflight})",
                self._tenant_turn_s(tenant, demand),
            )
        if limits.tokens_per_minute:
            cost = demand.num_prompt_tokens + demand.max_tokens
            if cost > limits.tokens_per_minute:
                raise InvalidRequestError(
                    f"the prompt and max_tokens come to {cost} tokens, more than this key's "
                    f"{limits.tokens_per_minute} per minute",
                    "max_tokens",
                )
            wait_s = self._bucket(tenant, limits).wait_s(cost)
            if wait_s > 0:
                self._refuse(
                    "tenant_tokens",
                    f"this key's {limits.tokens_per_minute} tokens per minute are used up",
                    wait_s,
                )

    def _tenant_turn_s(self, tenant: str, demand: KvDemand) -> float:
        """When the tenant's soonest-ending request is predicted to end."""
        ends = [
            self._time_left_s(admitted)
            for admitted in self._admitted.values()
            if admitted.tenant == tenant
        ]
        return min(ends, default=self._ttft_s + demand.max_tokens * self._tpot_s)

    def _bucket(self, tenant: str, limits: TenantLimits) -> TokenBucket:
        bucket = self._buckets.get(tenant)
        if bucket is None or bucket.capacity != limits.tokens_per_minute:
            bucket = self._buckets[tenant] = TokenBucket(limits.tokens_per_minute, self._clock)
        return bucket

    def _tags(
        self, tenant: str, limits: TenantLimits, demand: KvDemand, priority: int
    ) -> tuple[float, tuple[int, float, int]]:
        """Weighted fair queuing: a request's start tag is the later of the virtual time and
        its tenant's previous finish tag; its finish tag adds its KV over the tenant's
        weight. Admission order: higher priority, then the earlier finish tag, then arrival."""
        start = max(self._virtual_time, self._last_finish.get(tenant, 0.0))
        finish = start + demand.num_tokens / limits.weight
        return start, (-priority, finish, next(self._sequence))

    def _enter(self, tenant: str, sort_key: tuple[int, float, int]) -> None:
        """A request of ``tenant`` is admitted or waits: it counts in the tenant's requests
        in flight, and the tenant's next request queues behind its finish tag."""
        self._last_finish[tenant] = sort_key[1]
        self._inflight[tenant] = self._inflight.get(tenant, 0) + 1

    def _leave(self, tenant: str, unused_tokens: int) -> None:
        """A request of ``tenant`` left (ended, refused while waiting, or cancelled)."""
        left = self._inflight.get(tenant, 0) - 1
        if left > 0:
            self._inflight[tenant] = left
        else:
            self._inflight.pop(tenant, None)
        bucket = self._buckets.get(tenant)
        if bucket is not None and unused_tokens > 0:
            bucket.give_back(unused_tokens)

    def _refuse(self, reason: str, message: str, retry_after_s: float) -> NoReturn:
        self.refusals[reason] += 1
        raise OverloadedError(message, retry_after_s=retry_after_s)

    # ---- internals ---------------------------------------------------------------------

    def _fits(self, demand: KvDemand) -> bool:
        """Room in the KV, in the decode batch the TPOT target allows and in the prefill
        backlog (alone, anything the workers accept)."""
        if not self._admitted:
            return True
        if self._admitted_tokens + demand.num_tokens > self.capacity_tokens:
            return False
        slots = self._max_decoding(demand)
        if slots is not None and len(self._admitted) >= slots:
            return False
        return (
            self._backlog_prompts() < self._worker_capacity(0).prompt_workers
            or self._prefill_backlog + demand.num_prompt_tokens <= self.prefill_backlog_limit
        )

    def _backlog_prompts(self) -> int:
        """Admitted requests without a first token: the prompts of the prefill backlog."""
        return sum(1 for admitted in self._admitted.values() if admitted.last_token_at is None)

    @property
    def prefill_backlog_limit(self) -> int:
        """Prompt tokens the backlog may hold: ``prefill_backlog_s`` of prefill."""
        return int(self.config.prefill_backlog_s * self.prefill_tokens_per_s)

    def _queue_full(self, demand: KvDemand) -> bool:
        config = self.config
        return (
            len(self._queue) >= config.max_queued_requests
            or self._queued_prompt_tokens + demand.num_prompt_tokens
            > config.max_queued_prompt_tokens
        )

    def _grant(self, request_id: str, tenant: str, demand: KvDemand, start_tag: float) -> None:
        """Admit: its KV counts, its tenant's tokens are taken, the virtual time moves on."""
        self._admitted[request_id] = _Admitted(demand, tenant, demand.max_tokens, self._clock())
        self._admitted_tokens += demand.num_tokens
        if self._prefill_backlog == 0:
            self._backlog_busy_since = self._clock()
        self._prefill_backlog += demand.num_prompt_tokens
        bucket = self._buckets.get(tenant)
        if bucket is not None:
            bucket.take(demand.num_prompt_tokens + demand.max_tokens)
        self._virtual_time = max(self._virtual_time, start_tag)
        self._last_finish = {
            name: tag for name, tag in self._last_finish.items() if tag > self._virtual_time
        }

    def _calibrate(self, waiter: _Waiter) -> None:
        """Learn how far predictions fall short: the waits they are scaled by."""
        if waiter.predicted_wait_s < CALIBRATION_MIN_WAIT_S:
            return
        ratio = (self._clock() - waiter.enqueued_at) / waiter.predicted_wait_s
        self._wait_calibration += SMOOTHING * (ratio - self._wait_calibration)

    def _serve(self) -> None:
        """Admit waiters in admission order while the next one fits."""
        while self._queue:
            waiter = min(self._queue)
            if not self._fits(waiter.demand):
                return
            self._queue.remove(waiter)
            self._queued_prompt_tokens -= waiter.demand.num_prompt_tokens
            self._grant(waiter.request_id, waiter.tenant, waiter.demand, waiter.start_tag)
            waiter.granted.set_result(None)
            self._calibrate(waiter)
