"""The step-time model (``common/step_cost.py``): the fits recover known costs from steps, a
part without steps keeps its fit, a changed machine is followed; a real engine learns its own
model from the steps it runs and reports it in its load figures."""

from __future__ import annotations

import random

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.step_cost import MIN_STEPS, OnlineLinearFit, StepCostLearner, StepShape
from splitserve.engine.checkpoint import LoadedCheckpoint
from tests.conftest import make_llm

DECODE_BASE_S = 0.012
PER_SEQ_S = 0.0008
PER_CONTEXT_TOKEN_S = 2e-6
PREFILL_BASE_S = 0.004
PER_PREFILL_TOKEN_S = 0.0011


def _true_step_s(shape: StepShape) -> float:
    decode = 0.0
    if shape.decode_seqs:
        decode = DECODE_BASE_S + PER_SEQ_S * shape.decode_seqs
        decode += PER_CONTEXT_TOKEN_S * shape.context_tokens
    prefill = PREFILL_BASE_S + PER_PREFILL_TOKEN_S * shape.prefill_tokens
    return decode + (prefill if shape.prefill_tokens else 0.0)


def _random_shape(rng: random.Random, prefill: bool) -> StepShape:
    seqs = rng.randint(1, 32)
    return StepShape(
        decode_seqs=seqs,
        prefill_tokens=rng.randint(16, 512) if prefill else 0,
        context_tokens=seqs * rng.randint(64, 1500),
    )


def test_a_fit_recovers_exact_coefficients() -> None:
    fit = OnlineLinearFit(3, forgetting=1.0, ridge=0.0)
    rng = random.Random(0)
    for _ in range(50):
        x = [1.0, rng.uniform(0, 10), rng.uniform(0, 5)]
        fit.observe(x, 2.0 + 0.5 * x[1] + 3.0 * x[2])
    assert fit.coefficients() == pytest.approx([2.0, 0.5, 3.0], rel=1e-6)


def test_a_fit_clamps_negative_coefficients_and_rejects_bad_shapes() -> None:
    fit = OnlineLinearFit(2, forgetting=1.0, ridge=0.0)
    for x in range(1, 10):
        fit.observe([1.0, float(x)], 10.0 - x)  # slope -1
    assert fit.coefficients()[1] == 0.0
    with pytest.raises(ValueError):
        fit.observe([1.0], 1.0)
    with pytest.raises(ValueError):
        OnlineLinearFit(2, forgetting=0.0)


def test_the_learner_recovers_both_parts_from_noisy_steps() -> None:
    learner = StepCostLearner()
    rng = random.Random(1)
    assert not learner.estimate().knows_decode and not learner.estimate().knows_prefill
    for index in range(600):
        shape = _random_shape(rng, prefill=index % 4 == 0)
        learner.observe(shape, _true_step_s(shape) * rng.uniform(0.97, 1.03))
    cost = learner.estimate()
    assert cost.knows_decode and cost.knows_prefill
    assert cost.decode_steps == 450 and cost.prefill_steps == 150
    assert cost.per_prefill_token_s == pytest.approx(PER_PREFILL_TOKEN_S, rel=0.05)
    assert cost.per_decode_seq_s == pytest.approx(PER_SEQ_S, rel=0.2)
    for _ in range(20):  # predictions of unseen steps within a few percent
        shape = _random_shape(rng, prefill=rng.random() < 0.5)
        assert cost.step_s(shape) == pytest.approx(_true_step_s(shape), rel=0.05)


def test_a_part_without_steps_keeps_its_fit_and_a_slower_machine_is_followed() -> None:
    learner = StepCostLearner(forgetting=0.98)
    rng = random.Random(2)
    for _ in range(100):
        shape = _random_shape(rng, prefill=True)
        learner.observe(shape, _true_step_s(shape))
    prefill_rate = learner.estimate().per_prefill_token_s
    for _ in range(1000):  # decode only, on a machine that became twice as slow
        shape = _random_shape(rng, prefill=False)
        learner.observe(shape, 2 * _true_step_s(shape))
    cost = learner.estimate()
    assert cost.per_prefill_token_s == prefill_rate
    shape = StepShape(decode_seqs=8, prefill_tokens=0, context_tokens=4000)
    assert cost.step_s(shape) == pytest.approx(2 * _true_step_s(shape), rel=0.02)


def test_steps_without_work_or_time_are_ignored() -> None:
    learner = StepCostLearner()
    learner.observe(StepShape(0, 0, 0), 0.01)
    learner.observe(StepShape(4, 0, 100), 0.0)
    assert learner.estimate().decode_steps == 0


def test_an_engine_learns_its_own_step_cost(default_checkpoint_fp32: LoadedCheckpoint) -> None:
    llm = make_llm(default_checkpoint_fp32, max_num_batched_tokens=64)
    # One prompt at a time, each a single step of its own length (64 down to 4 tokens), then
    # two decode steps: the prompt steps' token counts span 16x, so the per-token cost is
    # identified (chunks of one size leave it to the ridge: a noisy run once fitted 0).
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
    lengths = [64, 4, 48, 8, 32, 12, 24, 16, 40, 6]
    for index, length in enumerate(lengths):
        llm.generate([[1000 + 7 * index + j for j in range(length)]], params)
    cost = llm.engine.load().step_cost
    assert cost.prefill_steps == len(lengths) and cost.decode_steps == 2 * len(lengths)
    assert cost.knows_prefill and cost.knows_decode
    assert cost.per_prefill_token_s > 0 and cost.decode_base_s + cost.per_decode_seq_s > 0
    # it reports the share of its time that went to prompt tokens, and its chunk size
    load = llm.engine.load()
    assert 0.0 < load.prefill_share < 1.0
    assert load.prefill_chunk_tokens == 64


def test_the_learner_says_how_much_of_a_step_was_prompt_work() -> None:
    learner = StepCostLearner()
    for _ in range(MIN_STEPS):
        assert learner.observe(StepShape(4, 0, 400), 0.020) == 0.0  # decode only
    # 0.5 s with 4 decodes (~0.020 s of it): the rest is the prompt's
    assert learner.observe(StepShape(4, 256, 400), 0.5) == pytest.approx(0.48, abs=1e-3)
