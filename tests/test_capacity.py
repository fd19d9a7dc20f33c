"""How many workers a coordinator's load needs (``coordinator/capacity.py``): demand measured
at the input, prompt tokens over a prefill worker's learned rate, decoding requests over the
batch a decode worker's learned steps serve within the TPOT target, KV over its KV."""

from __future__ import annotations

import math

import pytest

from splitserve.common.step_cost import StepCost
from splitserve.coordinator.admission import AdmissionSnapshot
from splitserve.coordinator.capacity import (
    DEMAND_HALF_LIFE_S,
    RATE_PROBE_TOKENS,
    CapacityTargets,
    DemandMeter,
    WorkerView,
    desired_workers,
)

PREFILL = StepCost(prefill_base_s=0.05, per_prefill_token_s=0.001, prefill_steps=100)
"""2,048 tokens in 2.098 s: about 976 prompt tokens a second."""
DECODE = StepCost(
    decode_base_s=0.01, per_decode_seq_s=0.002, per_context_token_s=1e-6, decode_steps=100
)
"""At 400 tokens of context a step of n requests is 10 + 2.4 n ms: 16 within 50 ms."""
TARGETS = CapacityTargets(tpot_s=0.05, wait_budget_s=2.0, utilization=1.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _snapshot(
    admitted: int = 0, queued: int = 0, queued_tokens: int = 0, kv: int = 0
) -> AdmissionSnapshot:
    return AdmissionSnapshot(
        capacity_tokens=100_000,
        admitted_tokens=kv,
        num_admitted=admitted,
        num_queued=queued,
        queued_prompt_tokens=queued_tokens,
        tpot_s=0.05,
        ttft_s=1.0,
        prefill_backlog_tokens=0,
        prefill_drain_tokens_per_s=None,
    )


def test_the_demand_meter_reads_a_steady_rate_and_forgets_a_burst() -> None:
    clock = Clock()
    meter = DemandMeter(clock)
    assert meter.rates() == (0.0, 0.0)
    for _ in range(600):  # 2 requests of 300 tokens a second for 5 minutes
        clock.now += 0.5
        meter.arrived(300)
    tokens, requests = meter.rates()
    assert tokens == pytest.approx(600, rel=0.05) and requests == pytest.approx(2, rel=0.05)
    clock.now += DEMAND_HALF_LIFE_S  # nothing more arrives: half the rate a half life later
    assert meter.rates()[0] == pytest.approx(300, rel=0.05)
    fresh = DemandMeter(clock)
    fresh.arrived(1000)
    clock.now += 2.0
    assert fresh.rates()[0] == pytest.approx(1000 / 2.0 * 0.5 ** (2 / DEMAND_HALF_LIFE_S))


def test_prefill_need_is_arriving_and_queued_tokens_over_a_workers_rate() -> None:
    rate = RATE_PROBE_TOKENS / PREFILL.prefill_s(RATE_PROBE_TOKENS)
    workers = [WorkerView(PREFILL, 10_000)] * 2
    decode = [WorkerView(DECODE, 10_000)]
    need = desired_workers((rate * 1.5, 5.0), _snapshot(), 400, workers, decode, TARGETS)
    assert need.prefill == pytest.approx(1.5)  # ceil: 2 workers
    queued = desired_workers(
        (rate * 1.5, 5.0), _snapshot(queued_tokens=round(rate)), 400, workers, decode, TARGETS
    )
    assert queued.prefill == pytest.approx(2.0, rel=1e-3)  # + a second's worth within 2 s
    tighter = desired_workers(
        (rate * 1.5, 5.0), _snapshot(), 400, workers, decode, CapacityTargets(0.05, 2.0, 0.75)
    )
    assert tighter.prefill == pytest.approx(2.0)
    unknown = desired_workers(
        (rate, 1.0), _snapshot(), 400, [WorkerView(StepCost(), 1)] * 3, decode, TARGETS
    )
    assert unknown.prefill == 3  # not learned yet: the workers it has


def test_decode_need_is_requests_over_the_batch_within_tpot_or_kv_over_a_workers_kv() -> None:
    decode = [WorkerView(DECODE, 40_000)]
    # 16 requests a worker within 50 ms at 400 tokens of context: 40 admitted + 8 waiting
    need = desired_workers((0.0, 0.0), _snapshot(admitted=40, queued=8), 400, [], decode, TARGETS)
    assert need.decode == pytest.approx(48 / 16)
    kv_bound = desired_workers(
        (0.0, 0.0), _snapshot(admitted=10, kv=100_000), 400, [], decode, TARGETS
    )
    assert kv_bound.decode == pytest.approx(2.5)  # 100k tokens of KV, 40k a worker
    idle = desired_workers((0.0, 0.0), _snapshot(), 400, [], decode, TARGETS)
    assert idle.decode == 0.0
    # a fleet of N at a need of at most N - 1 scales down: the survivors are within target
    assert (
        math.ceil(
            desired_workers((0.0, 0.0), _snapshot(admitted=31), 400, [], decode, TARGETS).decode
        )
        == 2
    )
