"""The prefill worker's learned KV push figure (``common/kv_push_cost.py``), torch-free: the
exposed transfer of its pushes, fitted per link, robust to a stall, and carried on the load
report to the coordinator (``proto/convert.py``)."""

from __future__ import annotations

import math
import random

import pytest

from splitserve.common.kv_push_cost import (
    MIN_PUSHES,
    NO_PUSH_COST,
    ExposedPushFit,
    KvPushCost,
    KvPushCosts,
    KvPushLearner,
)
from splitserve.common.load import EngineLoad
from splitserve.proto import convert

NARROW = KvPushCost(base_s=0.02, per_token_s=1e-4, pushes=MIN_PUSHES)
"""A narrow link: 20 ms plus 0.1 ms a token beyond the compute (an 8,000-token prompt's KV
outlasting its last chunk by 0.8 s)."""


def _narrow_s(tokens: int) -> float:
    return NARROW.base_s + NARROW.per_token_s * tokens


def _fed(fit: ExposedPushFit, pushes: int, rng: random.Random, noise_s: float) -> None:
    for _ in range(pushes):
        tokens = rng.randint(500, 8000)
        fit.observe(tokens, _narrow_s(tokens) + rng.uniform(-noise_s, noise_s))


def test_a_fit_is_unknown_and_predicts_nothing_until_it_saw_a_few_pushes() -> None:
    fit = ExposedPushFit()
    assert fit.estimate() == NO_PUSH_COST and fit.estimate().exposed_s(4000) == 0.0
    for _ in range(MIN_PUSHES - 1):
        fit.observe(4000, 0.5)
    assert not fit.estimate().known and fit.estimate().exposed_s(4000) == 0.0
    fit.observe(4000, 0.5)
    assert fit.estimate().known
    assert fit.estimate().exposed_s(4000) == pytest.approx(0.5, rel=1e-6)
    assert fit.estimate().exposed_s(0) == 0.0  # nothing travels, nothing exposed
    fit.observe(0, 9.0)  # a push of nothing teaches nothing
    assert fit.estimate().pushes == MIN_PUSHES


def test_exposed_times_fed_in_converge_to_the_links_figure() -> None:
    fit = ExposedPushFit()
    _fed(fit, 60, random.Random(1), noise_s=0.01)
    learned = fit.estimate()
    for tokens in (1000, 4000, 8000):
        assert learned.exposed_s(tokens) == pytest.approx(_narrow_s(tokens), rel=0.05)
    assert learned.per_token_s == pytest.approx(NARROW.per_token_s, rel=0.05)


def test_a_stall_moves_the_figure_by_a_bounded_step_that_decays_away() -> None:
    fit = ExposedPushFit()
    rng = random.Random(2)
    _fed(fit, 40, rng, noise_s=0.0)
    before = fit.estimate().exposed_s(4000)
    fit.observe(4000, 30.0)  # a 30 s stall (a GC pause, a retransmit storm) on one push
    after_stall = fit.estimate().exposed_s(4000)
    assert before < after_stall < 2 * before  # clipped: not pulled towards 30 s
    _fed(fit, 40, rng, noise_s=0.0)
    assert fit.estimate().exposed_s(4000) == pytest.approx(before, rel=0.01)


def test_a_link_that_narrows_is_learned_within_some_pushes_despite_the_clip() -> None:
    fit = ExposedPushFit()
    for _ in range(20):
        fit.observe(4000, 0.01)  # a wide link: the push hides behind the compute
    assert fit.estimate().exposed_s(4000) == pytest.approx(0.01, rel=0.01)
    for _ in range(30):
        fit.observe(4000, 2.0)  # then 2 s exposed for the same prompts
    assert fit.estimate().exposed_s(4000) == pytest.approx(2.0, rel=0.05)


def test_each_link_has_its_own_figure_and_an_unmeasured_one_takes_the_overall() -> None:
    learner = KvPushLearner()
    for _ in range(10):
        learner.observe("wide:1", 4000, 0.01)
        learner.observe("narrow:1", 4000, 1.0)
    learner.observe("new:1", 4000, 5.0)  # one push: not known yet
    costs = learner.estimate()
    assert costs.to("wide:1").exposed_s(4000) == pytest.approx(0.01, rel=0.01)
    assert costs.to("narrow:1").exposed_s(4000) == pytest.approx(1.0, rel=0.01)
    assert costs.to("new:1") == costs.to("unseen:1") == costs.overall
    assert costs.overall.pushes == 21 and 0.01 < costs.overall.exposed_s(4000) < 5.0
    learner.forget("narrow:1")
    assert [address for address, _ in learner.estimate().peers] == ["wide:1", "new:1"]
    assert KvPushCosts().to("any:1").exposed_s(4000) == 0.0


def test_the_figures_travel_on_the_load_report() -> None:
    learner = KvPushLearner()
    for tokens in (1000, 2000, 4000, 8000):
        learner.observe("d:1", tokens, _narrow_s(tokens))
    costs = learner.estimate()
    load = convert.load_from_proto(convert.load_to_proto(EngineLoad(kv_push=costs)))
    assert load.kv_push == costs
    assert convert.load_from_proto(convert.load_to_proto(EngineLoad())).kv_push == KvPushCosts()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_a_reported_coefficient_that_is_no_sane_number_counts_as_zero(bad: float) -> None:
    sent = KvPushCosts(KvPushCost(bad, bad, 5), (("d:1", KvPushCost(0.1, bad, 5)),))
    got = convert.load_from_proto(convert.load_to_proto(EngineLoad(kv_push=sent))).kv_push
    assert got == KvPushCosts(KvPushCost(0.0, 0.0, 5), (("d:1", KvPushCost(0.1, 0.0, 5)),))
