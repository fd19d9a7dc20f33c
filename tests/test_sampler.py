"""Tests of splitserve.engine.sampler: greedy, filters, penalties, seeds, logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import sampler as sampler_module
from splitserve.engine.sampler import (
    Sampler,
    SamplingRow,
    apply_filters,
    apply_penalties,
)
from splitserve.kernels.cpu_build import running_level
from splitserve.kernels.cpu_sampling import load_cpu_sampling
from tests.host_reads import HostReads

PROBS = [0.5, 0.3, 0.15, 0.05]
"""A hand-made distribution for top-p / min-p checks."""


def make_row(
    params: SamplingParams | None = None,
    *,
    seed: int | None = None,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: Sequence[int] = (),
) -> SamplingRow:
    """A row with a fresh generator when ``seed`` is given."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(
        params=params or SamplingParams(),
        generator=generator,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        eos_token_ids=frozenset(eos),
    )


@pytest.fixture(params=["torch", "native"])
def sampler(request: pytest.FixtureRequest) -> Sampler:
    """The sampler on torch's ops, and on the C++ kernels (``kernels/cpu_sampling.py``, at the
    level chosen for this CPU): every semantic test below holds for both."""
    if request.param == "torch":
        return Sampler()
    if running_level() is None:
        pytest.skip("this CPU runs no level of the C++ kernels")
    kernels = load_cpu_sampling()
    assert kernels is not None, "the sampling kernels are installed with the package"
    return Sampler(kernels)


def log_probs_row(probs: Sequence[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])  # [1, vocab]


def kept_tokens(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())


def token_frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).to(torch.float32)
    return counts / len(tokens)  # [vocab]


def test_greedy_is_argmax_for_any_dtype(sampler: Sampler) -> None:
    logits = torch.randn(6, 33, generator=torch.Generator().manual_seed(0))  # [batch, vocab]
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(6)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = sampler(logits.to(dtype), rows)
        assert out.token_ids == logits.to(dtype).float().argmax(dim=-1).tolist()
        assert out.logprobs == [None] * 6


def test_greedy_with_penalty_uses_penalized_logits(sampler: Sampler) -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    row = make_row(SamplingParams(temperature=0.0, repetition_penalty=2.0), output=[0])
    assert sampler(logits, [row]).token_ids == [1]


def test_temperature_sampling_matches_softmax(sampler: Sampler) -> None:
    vocab_logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    num_draws = 20_000
    logits = vocab_logits.expand(num_draws, 4)  # [draws, vocab]
    rows = [make_row(SamplingParams(temperature=0.7)) for _ in range(num_draws)]
    frequencies = token_frequencies(sampler(logits, rows).token_ids, 4)
    expected = torch.softmax(vocab_logits / 0.7, dim=-1)
    # Binomial std is at most 0.0036 here; 0.02 is more than 5 sigma.
    torch.testing.assert_close(frequencies, expected, atol=0.02, rtol=0)


def test_seeded_sampling_over_steps_matches_softmax(sampler: Sampler) -> None:
    vocab_logits = torch.tensor([[0.0, 1.0, 2.0]])
    row = make_row(SamplingParams(temperature=1.0), seed=7)
    tokens = [sampler(vocab_logits, [row]).token_ids[0] for _ in range(3000)]
    expected = torch.softmax(vocab_logits[0], dim=-1)
    torch.testing.assert_close(token_frequencies(tokens, 3), expected, atol=0.04, rtol=0)


def test_top_k_only_yields_the_k_best(sampler: Sampler) -> None:
    vocab_logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.0, 1.9, -3.0, 0.5])
    logits = vocab_logits.expand(4000, 8)  # [draws, vocab]
    rows = [make_row(SamplingParams(temperature=1.5, top_k=3)) for _ in range(4000)]
    assert set(sampler(logits, rows).token_ids) == {1, 3, 5}


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(0.3, {0}), (0.45, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (0.99, {0, 1, 2, 3})],
)
def test_top_p_keeps_smallest_nucleus(top_p: float, expected: set[int]) -> None:
    filtered = apply_filters(log_probs_row(PROBS), [SamplingParams(top_p=top_p)])
    assert kept_tokens(filtered) == expected


def test_top_p_sampling_renormalizes_nucleus(sampler: Sampler) -> None:
    logits = log_probs_row(PROBS).expand(20_000, 4)  # [draws, vocab]
    rows = [make_row(SamplingParams(top_p=0.75)) for _ in range(20_000)]
    frequencies = token_frequencies(sampler(logits, rows).token_ids, 4)
    expected = torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    torch.testing.assert_close(frequencies, expected, atol=0.02, rtol=0)


def test_top_k_then_top_p() -> None:
    # top_k=2 renormalizes to (0.625, 0.375); top_p=0.6 then keeps token 0 only.
    filtered = apply_filters(log_probs_row(PROBS), [SamplingParams(top_k=2, top_p=0.6)])
    assert kept_tokens(filtered) == {0}


def reference_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """Straightforward one-row top-k then top-p by a full sort (no ties in ``logits``)."""
    order = logits.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    probs = torch.softmax(logits[kept].double(), dim=-1).tolist()
    nucleus, mass = [], 0.0
    for token, prob in zip(kept, probs, strict=True):
        if nucleus and mass >= top_p:
            break
        nucleus.append(token)
        mass += prob
    return set(nucleus)


TIERS = [(256, 4096), (8, 64), (8,)]
"""The default tiers, narrow ones that send most rows of a 1,000- or 2,000-token vocabulary
to the second tier and some to the sort, and one tier then the sort."""


@pytest.mark.parametrize("tiers", TIERS)
def test_top_k_top_p_matches_full_sort_reference(
    monkeypatch: pytest.MonkeyPatch, tiers: tuple[int, ...]
) -> None:
    # Narrow tiers send most rows to the later tiers and the sort; results must not change.
    monkeypatch.setattr(sampler_module, "_NUCLEUS_TIERS", tiers)
    generator = torch.Generator().manual_seed(11)
    settings = [(0, 0.9), (5, 1.0), (50, 0.8), (300, 0.95), (0, 0.3), (20, 0.999), (0, 0.99)]
    logits = torch.randn(len(settings), 1000, generator=generator) * 3  # [rows, vocab]
    params = [SamplingParams(top_k=k, top_p=p) for k, p in settings]
    filtered = apply_filters(logits, params)
    for i, (top_k, top_p) in enumerate(settings):
        expected = reference_top_k_top_p(logits[i], top_k, top_p)
        assert kept_tokens(filtered[i : i + 1]) == expected, (top_k, top_p)


def test_ties_at_the_cut_off_are_kept() -> None:
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    assert kept_tokens(apply_filters(logits, [SamplingParams(top_k=2)])) == {0, 1, 2}


@pytest.mark.parametrize(
    ("min_p", "expected"), [(0.0, {0, 1, 2, 3}), (0.25, {0, 1, 2}), (0.35, {0, 1}), (1.0, {0})]
)
def test_min_p_drops_unlikely_tokens(min_p: float, expected: set[int]) -> None:
    filtered = apply_filters(log_probs_row(PROBS), [SamplingParams(min_p=min_p)])
    assert kept_tokens(filtered) == expected


def test_filters_are_per_row() -> None:
    logits = log_probs_row(PROBS).expand(3, 4)  # [3, vocab]
    params = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(min_p=0.35)]
    filtered = apply_filters(logits, params)
    assert [kept_tokens(filtered[i : i + 1]) for i in range(3)] == [{0}, {0, 1, 2, 3}, {0, 1}]


def test_penalties_exact_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    original = logits.clone()
    penalized = make_row(
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        prompt=[0],
        output=[1, 3, 3],
    )
    plain = make_row(prompt=[0], output=[1, 3, 3])
    processed = apply_penalties(logits, [penalized, plain])
    # repetition: 2/2, -1*2, -, 3/2, -; then minus 0.5*count + 0.25*present on output tokens.
    expected = torch.tensor([[1.0, -2.75, 0.5, 0.25, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    assert torch.equal(processed, expected)
    assert torch.equal(logits, original)


def test_logit_bias_is_added_after_min_tokens_and_before_penalties(sampler: Sampler) -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    params = SamplingParams(
        temperature=0.0, logit_bias={0: 1.5, 3: -4.0}, repetition_penalty=2.0, min_tokens=1
    )
    row = make_row(params, output=[], prompt=[0], eos=[2])
    # eos 2 suppressed; biases 2+1.5, 3-4; then the repetition penalty on token 0: 3.5 / 2
    expected = torch.tensor([[1.75, -1.0, float("-inf"), -1.0]])
    assert torch.equal(apply_penalties(logits, [row]), expected)
    assert sampler(logits, [row]).token_ids == [0]
    assert sampler(logits, [make_row(SamplingParams(temperature=0.0))]).token_ids == [3]


def test_logit_bias_in_seeded_sampling_is_the_biased_distribution(sampler: Sampler) -> None:
    logits = torch.zeros(1, 4)
    biased = SamplingParams(temperature=1.0, logit_bias={1: math.log(7.0)})  # p = 0.7 for 1
    row = make_row(biased, seed=3)
    tokens = [sampler(logits, [row]).token_ids[0] for _ in range(4000)]
    expected = torch.tensor([0.1, 0.7, 0.1, 0.1])
    assert torch.allclose(token_frequencies(tokens, 4), expected, atol=0.03)


def test_presence_and_frequency_ignore_prompt_tokens() -> None:
    logits = torch.zeros(1, 4)
    row = make_row(
        SamplingParams(frequency_penalty=1.0, presence_penalty=1.0), prompt=[0, 0], output=[2]
    )
    assert apply_penalties(logits, [row]).tolist() == [[0.0, 0.0, -2.0, 0.0]]


def test_min_tokens_suppresses_eos_and_stop_token_ids(sampler: Sampler) -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0]])  # eos=2, stop token 3
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    for output, expected in (([], 1), ([1], 1), ([1, 1], 2)):
        row = make_row(params, output=output, eos=[2])
        assert sampler(logits, [row]).token_ids == [expected]
    sampled = SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=(3,))
    rows = [make_row(sampled, eos=[2]) for _ in range(500)]
    assert set(sampler(logits.expand(500, 4), rows).token_ids) <= {0, 1}


def _run_seeded(sampler: Sampler, batch_builder, steps: int = 25) -> list[int]:
    """Sample ``steps`` tokens for a seed-1234 target row placed by ``batch_builder``."""
    target = make_row(SamplingParams(temperature=0.9, top_p=0.95, seed=1234), seed=1234)
    step_generator = torch.Generator().manual_seed(99)
    tokens = []
    for _ in range(steps):
        target_logits = torch.randn(64, generator=step_generator)  # [vocab]
        rows, position = batch_builder(target)
        logits = torch.randn(len(rows), 64)  # [batch, vocab], neighbours get noise
        logits[position] = target_logits
        token = sampler(logits, rows).token_ids[position]
        tokens.append(token)
        target.output_token_ids = [*target.output_token_ids, token]
    return tokens


def test_same_seed_same_tokens_in_any_batch(sampler: Sampler) -> None:
    alone = _run_seeded(sampler, lambda target: ([target], 0))
    neighbours = [
        make_row(SamplingParams(temperature=1.0, seed=5), seed=5),
        make_row(SamplingParams(temperature=0.5, top_k=3)),
        make_row(SamplingParams(temperature=0.0, repetition_penalty=1.3), output=[1, 2]),
        make_row(SamplingParams(min_p=0.1, frequency_penalty=0.5, logprobs=2), output=[3]),
    ]
    at_end = _run_seeded(sampler, lambda target: ([*neighbours, target], 4))
    in_middle = _run_seeded(sampler, lambda target: ([neighbours[1], target, neighbours[0]], 1))
    assert alone == at_end == in_middle


WAIT_FREE_SETTINGS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.2, top_p=0.97),
    SamplingParams(temperature=0.7, top_k=40),
    SamplingParams(temperature=1.0, top_k=300),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.8),
    SamplingParams(temperature=0.9, top_p=0.95, min_p=0.02),
    SamplingParams(temperature=1.0, top_k=5000),
]
"""Greedy, plain, top-p, top-k within and beyond 256 candidates, both, min-p after them, and a
top-k past the vocabulary (off)."""
ROWS = 2 * len(WAIT_FREE_SETTINGS)


def _wait_free_batch(step: int) -> tuple[torch.Tensor, list[SamplingRow]]:
    """One batch of ``WAIT_FREE_SETTINGS`` rows twice over, peaked and flat logits
    ``[ROWS, 2000]`` (a flat row's 0.9 nucleus lies beyond 256 candidates), each row seeded by
    ``step`` and its index."""
    generator = torch.Generator().manual_seed(step)
    logits = torch.randn(ROWS, 2000, generator=generator)  # [rows, vocab]
    logits[: ROWS // 2] *= 6.0  # peaked: the nucleus within the candidates
    logits[ROWS // 2 :] *= 0.2  # flat: beyond them
    params = WAIT_FREE_SETTINGS * 2
    rows = [make_row(p, seed=1000 * step + i) for i, p in enumerate(params)]
    return logits, rows


@pytest.mark.parametrize("tiers", TIERS)
def test_a_wait_free_choice_is_the_choice_read_on_the_host(
    monkeypatch: pytest.MonkeyPatch, tiers: tuple[int, ...]
) -> None:
    # Narrow tiers: most rows' cut-offs lie beyond the first, on peaked rows too.
    monkeypatch.setattr(sampler_module, "_NUCLEUS_TIERS", tiers)
    for step in range(30):
        read = Sampler().choose(*_wait_free_batch(step))
        wait_free = Sampler().choose(*_wait_free_batch(step), wait_free=True)
        assert wait_free.tolist() == read.tolist(), step
    # The flat top-p rows' cut-offs do lie beyond their candidates: the sort decides them.
    logits, rows = _wait_free_batch(0)
    params = [row.params for row in rows]
    scaled = logits / torch.tensor([max(p.temperature, 1e-5) for p in params])[:, None]
    nucleus = sampler_module._NucleusRows.of(scaled, params)
    flat = ROWS // 2
    beyond = [flat + 2, flat + 3, flat + 5, flat + 7]  # top-p 0.9, 0.97, 0.95; top-k 300
    assert not nucleus.complete[beyond].any()


def test_narrow_tiers_decide_rows_at_every_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    """With tiers (8, 64), the batches above have rows decided by each tier and by the sort,
    so the equality tests cover every way a row's cut-off is found."""
    monkeypatch.setattr(sampler_module, "_NUCLEUS_TIERS", (8, 64))
    logits, rows = _wait_free_batch(0)
    params = [row.params for row in rows]
    scaled = logits / torch.tensor([max(p.temperature, 1e-5) for p in params])[:, None]
    nucleus = sampler_module._NucleusRows.of(scaled, params)
    beyond_first = torch.nonzero(~nucleus.complete).flatten()  # [r]
    within_second = nucleus.cutoff_among(
        scaled[beyond_first], beyond_first, scaled[beyond_first].topk(64, dim=-1).values
    )[1]
    top_p_rows = torch.tensor([p.top_p < 1.0 for p in params])  # [rows]
    assert (nucleus.complete & top_p_rows).any()
    assert within_second.any() and not within_second.all()


def test_a_wait_free_choice_reads_nothing_on_the_host() -> None:
    logits, rows = _wait_free_batch(0)
    with HostReads():
        Sampler().choose(logits, rows, wait_free=True)
    # The guard sees the read that the other path makes for the flat top-p rows.
    with pytest.raises(AssertionError, match="read on the host"), HostReads():
        Sampler().choose(logits, rows)


def test_different_seeds_differ(sampler: Sampler) -> None:
    logits = torch.zeros(1, 1000)  # uniform: two seeds agree 20 times with odds 1e-60

    def draw(seed: int) -> list[int]:
        row = make_row(SamplingParams(seed=seed), seed=seed)
        return [sampler(logits, [row]).token_ids[0] for _ in range(20)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_logprobs_from_raw_logits(sampler: Sampler) -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    rows = [
        make_row(SamplingParams(temperature=0.0, logprobs=5)),
        make_row(SamplingParams(temperature=2.0, logprobs=0), seed=1),
        make_row(SamplingParams(temperature=0.0)),
        make_row(
            SamplingParams(temperature=0.8, logprobs=20, repetition_penalty=1.5), output=[0, 1]
        ),
    ]
    out = sampler(logits, rows)
    reference = torch.log_softmax(logits.float(), dim=-1)  # [batch, vocab]
    assert out.logprobs[2] is None
    for i, count in ((0, 5), (1, 0), (3, 20)):
        info = out.logprobs[i]
        assert info is not None
        token = out.token_ids[i]
        assert info.token_id == token
        assert info.logprob == pytest.approx(reference[i, token].item(), abs=1e-6)
        assert info.rank == 1 + int((reference[i] > reference[i, token]).sum())
        assert len(info.top) == count
        top_values = [lp for _, lp in info.top]
        assert top_values == sorted(top_values, reverse=True)
        for token_id, logprob in info.top:
            assert logprob == pytest.approx(reference[i, token_id].item(), abs=1e-6)
        if count:
            assert info.top[0][0] == int(reference[i].argmax())
    assert out.logprobs[0] is not None and out.logprobs[0].rank == 1


def test_rejects_mismatched_batch_and_handles_empty() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), [make_row()])
    assert Sampler()(torch.zeros(0, 5), []).token_ids == []


def test_allowed_token_ids_are_the_only_tokens(sampler: Sampler) -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]]).expand(2000, 5)  # [draws, vocab]
    rows = [make_row(SamplingParams(allowed_token_ids=(1, 3))) for _ in range(2000)]
    assert set(sampler(logits, rows).token_ids) == {1, 3}
    greedy = make_row(SamplingParams(temperature=0.0, allowed_token_ids=(2, 4)))
    assert sampler(logits[:1], [greedy]).token_ids == [2]
    # the mask beats min_tokens, as a grammar's: EOS only allowed is still chosen
    ending = make_row(
        SamplingParams(temperature=0.0, min_tokens=3, allowed_token_ids=(4,)), eos=[4]
    )
    assert sampler(logits[:1], [ending]).token_ids == [4]


def test_a_bad_word_s_last_token_is_banned_after_its_others(sampler: Sampler) -> None:
    logits = torch.tensor([[1.0, 9.0, 8.0, 0.0]])
    words = ((1,), (3, 2))  # token 1 always; token 2 right after 3
    fresh = SamplingParams(temperature=0.0, bad_words=("w",), bad_words_token_ids=words)
    assert sampler(logits, [make_row(fresh, output=[0])]).token_ids == [2]
    assert sampler(logits, [make_row(fresh, output=[3])]).token_ids == [0]
    assert sampler(logits, [make_row(fresh, prompt=[3], output=[])]).token_ids == [2]
    sampled = SamplingParams(bad_words=("w",), bad_words_token_ids=words)
    rows = [make_row(sampled, output=[3]) for _ in range(500)]
    assert set(sampler(logits.expand(500, 4), rows).token_ids) <= {0, 3}
