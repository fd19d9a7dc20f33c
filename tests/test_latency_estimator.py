"""Admission's estimates (``coordinator/latency_estimator.py``) on plain numbers: the measured
averages move a tenth of the way, the prediction plays the queue forward, the backlog drain
rate is measured over windows while the backlog is loaded, and late waits scale later
predictions."""

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


DRAIN_OUTLOOK = KvOutlook(
    free_tokens=10_000,
    free_slots=math.inf,
    running=[],
    backlog_tokens=100,
    backlog_limit_tokens=100,
    prefill_tokens_per_s=10_000.0,
)


def join(estimate: LatencyEstimator, now: float, held: int, joining: int) -> None:
    """``joining`` prompts join a backlog of ``held`` at ``now``, one by one."""
    for count in range(held + 1, held + joining + 1):
        estimate.backlog_changed(now=now, backlog_prompts=count)


def test_the_backlog_drain_rate_is_tokens_over_loaded_time_across_a_window() -> None:
    estimate = LatencyEstimator(prior_ttft_s=0.0, prior_tpot_s=0.05)
    # at the compute rate, 100 more tokens wait for 0.01 s of prefill
    assert estimate.predicted_wait_s(DRAIN_OUTLOOK, [demand(100, 4)]) == pytest.approx(0.01)
    join(estimate, now=10.0, held=0, joining=12)
    # a step finishes four prompts at once, 0.2 s after the backlog filled: the first three
    # close the window's time, the burst's tokens all count (not three rates of 0 s)
    for left in (11, 10, 9):
        estimate.prompt_prefilled(50, now=10.25, backlog_prompts=left)
    assert estimate.drain_tokens_per_s is None  # three prompts: no window yet
    estimate.prompt_prefilled(50, now=10.25, backlog_prompts=8)
    assert estimate.drain_tokens_per_s == pytest.approx(200 / 0.25)
    assert estimate.predicted_wait_s(DRAIN_OUTLOOK, [demand(100, 4)]) == pytest.approx(0.125)
    # the next window moves it a tenth of the way: 4 x 100 tokens in 0.125 s
    for left in (7, 6, 5, 4):
        estimate.prompt_prefilled(100, now=10.375, backlog_prompts=left)
    assert estimate.drain_tokens_per_s == pytest.approx(800 + 0.1 * (3200 - 800))
    # the last prompt left alone is latency: with three counted, no window closes
    for left in (3, 2, 1, 0):
        estimate.prompt_prefilled(100, now=11.0, backlog_prompts=left)
    assert estimate.drain_tokens_per_s == pytest.approx(1040)


def test_a_lone_prompts_time_to_first_token_is_not_a_drain_rate() -> None:
    """A fresh cluster's first prompt took 2 s (cold paths, a crowd arriving): that is its
    latency. Counted as drain, 16 tokens over 2 s refused a crowd on a wait of 30 s."""
    estimate = LatencyEstimator(prior_ttft_s=0.0, prior_tpot_s=0.05)
    for _ in range(10):  # alone in the backlog each time, 2 s to its first token
        estimate.backlog_changed(now=0.0, backlog_prompts=1)
        estimate.prompt_prefilled(16, now=2.0, backlog_prompts=0)
    assert estimate.drain_tokens_per_s is None
    assert estimate.predicted_wait_s(DRAIN_OUTLOOK, [demand(100, 4)]) == pytest.approx(0.01)
    # the stretch before a second prompt joined is not counted either
    join(estimate, now=0.0, held=0, joining=1)
    join(estimate, now=1.9, held=1, joining=3)
    for left in (3, 2, 1, 0):
        estimate.prompt_prefilled(16, now=2.0, backlog_prompts=left)
    # loaded from 1.9 s; the last prompt left an unloaded backlog: 3 prompts counted
    assert estimate.drain_tokens_per_s is None
    join(estimate, now=3.0, held=0, joining=2)
    estimate.prompt_prefilled(16, now=3.1, backlog_prompts=1)
    assert estimate.drain_tokens_per_s == pytest.approx(64 / 0.2)


def test_a_prompt_leaving_undrained_ends_a_loaded_stretch_only_below_the_load() -> None:
    estimate = LatencyEstimator(prior_ttft_s=0.0, prior_tpot_s=0.05)
    join(estimate, now=0.0, held=0, joining=2)
    estimate.backlog_changed(now=5.0, backlog_prompts=1)  # one ended before its first token
    join(estimate, now=9.75, held=1, joining=4)
    for left in (4, 3, 2, 1):
        estimate.prompt_prefilled(25, now=10.0, backlog_prompts=left)
    assert estimate.drain_tokens_per_s == pytest.approx(100 / 0.25)  # not 100 over 10 s


def test_waits_longer_than_predicted_scale_predictions_and_short_ones_do_not_count() -> None:
    estimate = LatencyEstimator(prior_ttft_s=0.0, prior_tpot_s=0.05)
    estimate.waited(waited_s=3.0, predicted_s=0.1)  # too short to count
    assert estimate.predicted_wait_s(FAST_PREFILL, [demand(16, 16)]) == pytest.approx(0.8)
    estimate.waited(waited_s=3.0, predicted_s=1.0)  # 1 + 0.1 x (3 - 1) = 1.2
    assert estimate.predicted_wait_s(FAST_PREFILL, [demand(16, 16)]) == pytest.approx(0.96)
    for _ in range(50):
        estimate.waited(waited_s=0.1, predicted_s=1.0)  # faster than predicted: never below 1
    assert estimate.predicted_wait_s(FAST_PREFILL, [demand(16, 16)]) == pytest.approx(0.8)
