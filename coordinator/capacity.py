"""How many prefill and decode workers this coordinator's load needs now, in worker units:
``splitserve_desired_workers{role}`` (``metrics.py``), which the autoscalers scale on
(``deploy/base/autoscaling.yaml``: KEDA runs ``ceil(sum over coordinators)`` replicas).

Demand is measured at the input, never at the output (a closed loop whose output is capped
by too few workers would never ask for more):

- prefill: the prompt tokens arriving a second (every request that reached admission,
  refused ones included: ``DemandMeter``), plus the prompt tokens waiting in admission's queue
  and the prefill backlog drained within ``wait_budget_s``; over one prefill worker's learned
  rate (its step-time model at a step's budget of prompt tokens), at ``utilization``;
- decode: the requests admitted and waiting, over the batch one decode worker's learned steps
  decode within the TPOT target (``decode_batch_within``, at the admitted
  requests' average context), or the KV they need over one worker's KV, whichever is more,
  at ``utilization``.

A figure is in worker units, not rounded: the sum over coordinators is the fleet's need. A
scale-down to ``N - 1`` workers happens only once the need is at most ``N - 1``: the
survivors' added load is in the figure by construction. Scale-down is also held off for the
HPA's stabilization window and always drains (SIGTERM: ``docs/architecture.md``). While a
role's step-time model is not learned yet, its figure is the workers it has (no change).
Single event loop; pure but for the meter's clock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitserve.common.step_cost import StepCost
from splitserve.coordinator.admission import AdmissionSnapshot

RATE_PROBE_TOKENS = 2048
"""Prompt tokens a worker's prefill rate is read at (a step's budget)."""
DEMAND_HALF_LIFE_S = 30.0
"""The arrival rate's memory: a burst counts fully at once and halves every this long."""


class DemandMeter:
    """Prompt tokens and requests arriving a second, as exponentially decaying sums (half
    life ``DEMAND_HALF_LIFE_S``) over the time since the first arrival, never longer ago
    than that (so a fresh meter is not a slow one)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tokens = 0.0
        self._requests = 0.0
        self._at: float | None = None
        self._first: float | None = None

    def arrived(self, prompt_tokens: int) -> None:
        now = self._decay()
        self._tokens += prompt_tokens
        self._requests += 1
        if self._first is None:
            self._first = now

    def rates(self) -> tuple[float, float]:
        """(prompt tokens, requests) a second."""
        now = self._decay()
        if self._first is None:
            return 0.0, 0.0
        span = DEMAND_HALF_LIFE_S / math.log(2)  # the decaying sum's time constant
        window = min(span, max(now - self._first, 1.0))
        return self._tokens / window, self._requests / window

    def _decay(self) -> float:
        now = self._clock()
        if self._at is not None:
            factor = 0.5 ** ((now - self._at) / DEMAND_HALF_LIFE_S)
            self._tokens *= factor
            self._requests *= factor
        self._at = now
        return now


def decode_batch_within(cost: StepCost, context_tokens: int, target_s: float) -> int | None:
    """The most requests of ``context_tokens`` a worker's decode steps serve within
    ``target_s`` per step (at least 1); None while its decode model is not learned."""
    if not cost.knows_decode:
        return None
    per_request_s = cost.per_decode_seq_s + cost.per_context_token_s * context_tokens
    if per_request_s <= 0:
        return None
    return max(1, math.floor((target_s - cost.decode_base_s) / per_request_s))


@dataclass(frozen=True)
class CapacityTargets:
    """What the fleet is sized for."""

    tpot_s: float
    """Decode steps within this (the TPOT target)."""
    wait_budget_s: float = 2.0
    """Prompt tokens queued now should be computed within this."""
    utilization: float = 0.8
    """Of each worker's measured capacity (headroom for bursts and noise)."""


@dataclass(frozen=True)
class WorkerView:
    """One worker as the sizing reads it."""

    cost: StepCost
    kv_tokens: int


@dataclass(frozen=True)
class DesiredWorkers:
    """Workers the load needs now, in worker units (module docstring)."""

    prefill: float
    decode: float


def desired_workers(
    demand: tuple[float, float],
    admission: AdmissionSnapshot,
    average_context_tokens: float,
    prefill_workers: Sequence[WorkerView],
    decode_workers: Sequence[WorkerView],
    targets: CapacityTargets,
) -> DesiredWorkers:
    """See the module docstring. ``demand``: ``DemandMeter.rates``."""
    prompt_tokens_per_s, _ = demand
    return DesiredWorkers(
        prefill=_prefill_need(prompt_tokens_per_s, admission, prefill_workers, targets),
        decode=_decode_need(admission, average_context_tokens, decode_workers, targets),
    )


def _prefill_need(
    prompt_tokens_per_s: float,
    admission: AdmissionSnapshot,
    workers: Sequence[WorkerView],
    targets: CapacityTargets,
) -> float:
    known = [w.cost for w in workers if w.cost.knows_prefill]
    if not known:
        return float(len(workers))
    per_worker = sum(c.prefill_tokens_per_s(RATE_PROBE_TOKENS) for c in known) / len(known)
    waiting = admission.queued_prompt_tokens + admission.prefill_backlog_tokens
    tokens_per_s = prompt_tokens_per_s + waiting / targets.wait_budget_s
    return tokens_per_s / (per_worker * targets.utilization)


def _decode_need(
    admission: AdmissionSnapshot,
    average_context_tokens: float,
    workers: Sequence[WorkerView],
    targets: CapacityTargets,
) -> float:
    known = [w for w in workers if w.cost.knows_decode]
    if not known:
        return float(max(1, len(workers)))
    context = round(average_context_tokens)
    batches = [decode_batch_within(w.cost, context, targets.tpot_s) or 1 for w in known]
    per_worker_batch = sum(batches) / len(batches)
    per_worker_kv = sum(w.kv_tokens for w in known) / len(known)
    requests = admission.num_admitted + admission.num_queued
    kv_tokens = admission.admitted_tokens + admission.queued_prompt_tokens
    need = max(requests / per_worker_batch, kv_tokens / max(per_worker_kv, 1))
    return max(need / targets.utilization, 1.0 if requests else 0.0)
