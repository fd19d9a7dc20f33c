"""Admission's estimates (``coordinator/latency_estimator.py``) on plain numbers: the measured
averages move a tenth of the way, the prediction plays the queue forward, the backlog drain
rate is measured while the backlog is busy, and late waits scale later predictions."""

from __future__ import annotations

import math

import pytest

from splitserve.coordinator.kv_demand import KvDemand
from splitserve.coordinator.latency_estimator import KvOutlook, LatencyEstimator, RunningEnd

FAST_PREFILL = KvOutlook(
    free_tokens=0,
    free_slots=math.inf,
    running=[RunningEnd(0.8, 32), RunningEnd(2.4, 64)],
    backlog_tokens=0,
    backlog_limit_tokens=1_000_000,
    prefill_tokens_per_s=1e9,
)


def demand(prompt: int, max_tokens: int) -> KvDemand:
    return KvDemand.of(prompt, max_tokens, 16)


def test_measurements_move_the_averages_a_tenth_of_the_way() -> None:
    estimate = LatencyEstimator(prior_ttft_s=1.0, prior_tpot_s=0.05)
    estimate.first_token(2.0)
    estimate.output_tokens(4, 0.4)  # 0.1 s per token
    assert estimate.ttft_s == pytest.approx(1.1) and estimate.tpot_s == pytest.approx(0.055)
    assert estimate.run_time_s(10) == pytest.approx(1.1 + 0.55)


def test_time_left_counts_what_remains_of_the_first_token_time() -> None:
    estimate = LatencyEstimator(prior_ttft_s=1.0, prior_tpot_s=0.05)
    assert estimate.time_left_s(10, waited_s=None) == pytest.approx(0.5)
    assert estimate.time_left_s(10, waited_s=0.25) == pytest.approx(0.75 + 0.5)
    assert estimate.time_left_s(10, waited_s=5.0) == pytest.approx(0.5)  # overdue: not < 0


def test_the_prediction_waits_for_enough_kv_and_plays_the_queue_forward() -> None:
    estimate = LatencyEstimator(prior_ttft_s=0.0, prior_tpot_s=0.05)
    assert estimate.predicted_wait_s(FAST_PREFILL, [demand(16, 16)]) == pytest.approx(0.8)
    assert estimate.predicted_wait_s(FAST_PREFILL, [demand(48, 16)]) == pytest.approx(2.4)
    # the first (32 tokens) starts at 0.8 s and holds its KV for 16 x 0.05 s: 1.6 s
    queue = [demand(16, 16), demand(16, 16), demand(16, 16)]
    assert estimate.predicted_wait_s(FAST_PREFILL, queue) == pytest.approx(2.4)


def test_the_backlog_drain_rate_is_measured_while_it_is_busy() -> None:
    estimate = LatencyEstimator(prior_ttft_s=0.0, prior_tpot_s=0.05)
    outlook = KvOutlook(
        free_tokens=10_000,
        free_slots=math.inf,
        running=[],
        backlog_tokens=100,
        backlog_limit_tokens=100,
        prefill_tokens_per_s=10_000.0,
    )
    # at the compute rate, 100 more tokens wait for 0.01 s of prefill
    assert estimate.predicted_wait_s(outlook, [demand(100, 4)]) == pytest.approx(0.01)
    estimate.backlog_filled(now=10.0)
    estimate.prompt_prefilled(100, now=10.1, backlog_tokens=0)  # 1000 tokens per second
    assert estimate.predicted_wait_s(outlook, [demand(100, 4)]) == pytest.approx(0.1)
    estimate.backlog_emptied()
    estimate.prompt_prefilled(100, now=20.0, backlog_tokens=0)  # idle since: no measurement
    assert estimate.predicted_wait_s(outlook, [demand(100, 4)]) == pytest.approx(0.1)


def test_waits_longer_than_predicted_scale_predictions_and_short_ones_do_not_count() -> None:
    estimate = LatencyEstimator(prior_ttft_s=0.0, prior_tpot_s=0.05)
    estimate.waited(waited_s=3.0, predicted_s=0.1)  # too short to count
    assert estimate.predicted_wait_s(FAST_PREFILL, [demand(16, 16)]) == pytest.approx(0.8)
    estimate.waited(waited_s=3.0, predicted_s=1.0)  # 1 + 0.1 x (3 - 1) = 1.2
    assert estimate.predicted_wait_s(FAST_PREFILL, [demand(16, 16)]) == pytest.approx(0.96)
    for _ in range(50):
        estimate.waited(waited_s=0.1, predicted_s=1.0)  # faster than predicted: never below 1
    assert estimate.predicted_wait_s(FAST_PREFILL, [demand(16, 16)]) == pytest.approx(0.8)
