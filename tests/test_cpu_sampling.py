"""The C++ sampling kernels (``kernels/cpu_sampling.py``), at every level this CPU executes:
the draw against the sampler's torch path and against exact (float64) arithmetic, the filters'
kept sets on hand-made rows, and the logprobs against float64 ``log_softmax``."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.sampler import apply_filters
from splitserve.kernels.cpu_sampling import CpuSampling, load_cpu_sampling
from tests.kernel_levels import level_params, require_level

LEVELS = level_params("sampling")
NEG_INF = float("-inf")


def _kernels(level: str) -> CpuSampling:
    """The kernels at ``level``; installed with the package, so a missing library fails."""
    require_level(level)
    kernels = load_cpu_sampling(level)
    assert kernels is not None, f"sampling at {level}"
    return kernels


def _sample(
    kernels: CpuSampling, logits: torch.Tensor, params: list[SamplingParams], uniform: torch.Tensor
) -> torch.Tensor:
    """``CpuSampling.sample`` with each row's settings taken from ``params``."""
    vocab = logits.shape[1]
    return kernels.sample(
        logits.contiguous(),
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
        top_k=torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params]),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
        uniform=uniform.contiguous(),
    )


def _kept(kernels: CpuSampling, logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """The tokens one row can draw: its draws over 2,001 uniforms spread over [0, 1)."""
    uniform = torch.linspace(0.0, 1.0, 2002, dtype=torch.float32)[:-1]
    rows = logits.expand(len(uniform), -1)
    return set(_sample(kernels, rows, [params] * len(uniform), uniform).tolist())


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.95),
    SamplingParams(temperature=1.3, top_k=40),
    SamplingParams(temperature=1.0, top_k=300, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=2.0, top_p=0.97),
]
"""Plain, top-p, top-k (within and beyond a floor's candidates), both, min-p, all three, flat."""


def _rows(count: int, vocab: int, seed: int) -> torch.Tensor:
    """``[count, vocab]`` logits shaped like a language model's: a spread of tokens, a few far
    above them (peaked rows) or none (flat rows), and some -inf (a grammar's mask)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(count, vocab, generator=generator) * 2.0
    heads = torch.randint(0, vocab, (count, 8), generator=generator)
    lift = torch.rand(count, 8, generator=generator) * 12.0
    lift[count // 2 :] = 0.0  # the second half flat
    logits.scatter_add_(1, heads, lift)
    masked = torch.rand(count, vocab, generator=generator) < 0.05
    masked[:, heads[:, 0]] = False
    return logits.masked_fill(masked, NEG_INF)


@pytest.mark.parametrize("level", LEVELS)
def test_the_draw_is_exact_arithmetic_and_torch_s_but_at_rounding(level: str) -> None:
    """Every row's token is the one exact arithmetic gives, from the kept set torch's filters
    keep (within 1e-5 of the total mass, which float sums reach); torch's float32 path gives
    the same token on all but a few rows, each at such a boundary."""
    kernels = _kernels(level)
    vocab, count = 3000, 400
    logits = _rows(count, vocab, seed=5)
    params = [SETTINGS[i % len(SETTINGS)] for i in range(count)]
    uniform = torch.rand(count, generator=torch.Generator().manual_seed(6))
    drawn = _sample(kernels, logits, params, uniform).tolist()
    differ = 0
    for i, (row, setting) in enumerate(zip(logits, params, strict=True)):
        scores = apply_filters((row / setting.temperature)[None], [setting])[0]  # torch's filters
        probs = torch.softmax(scores.double(), dim=-1)  # [vocab], 0 where dropped
        cdf = probs.cumsum(dim=-1)
        token, target = drawn[i], uniform[i].item() * cdf[-1].item()
        assert probs[token] > 0, f"row {i}: token {token} was dropped or masked"
        below = cdf[token - 1].item() if token else 0.0
        assert below - 1e-5 <= target <= cdf[token].item() + 1e-5, f"row {i}"
        torch_cdf = torch.softmax(scores, dim=-1).cumsum(dim=-1)  # the torch path's float32
        torch_token = int(torch.searchsorted(torch_cdf, uniform[i] * torch_cdf[-1], right=True))
        if torch_token != token:
            differ += 1
            boundary = cdf[min(token, torch_token)].item()
            assert abs(boundary - target) < 1e-5, f"row {i}: parted away from a boundary"
    assert differ <= count // 100


@pytest.mark.parametrize("level", LEVELS)
def test_the_filters_keep_what_the_torch_filters_keep(level: str) -> None:
    kernels = _kernels(level)
    logits = _rows(24, 500, seed=9)
    for i, row in enumerate(logits):
        setting = SETTINGS[i % len(SETTINGS)]
        if setting.top_k == 0 and setting.top_p == 1.0 and setting.min_p == 0.0:
            continue  # nothing filtered: a sweep of 2,001 uniforms would miss rare tokens
        scaled = (row / setting.temperature)[None]
        expected = set(torch.isfinite(apply_filters(scaled, [setting])[0]).nonzero()[:, 0].tolist())
        probs = torch.softmax(apply_filters(scaled, [setting])[0].double(), dim=-1)
        likely = {t for t in expected if probs[t] > 1e-3}  # what the sweep must hit
        assert likely <= _kept(kernels, row[None], setting) <= expected, f"row {i}"


PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        (SamplingParams(top_p=0.3), {0}),
        (SamplingParams(top_p=0.75), {0, 1}),
        (SamplingParams(top_p=0.85), {0, 1, 2}),
        (SamplingParams(top_p=0.99), {0, 1, 2, 3}),
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_k=2, top_p=0.6), {0}),  # top-k renormalizes to 0.625 / 0.375
        (SamplingParams(min_p=0.2), {0, 1, 2}),  # 0.05 < 0.2 * 0.5
        (SamplingParams(min_p=0.7), {0}),
    ],
)
def test_hand_made_cut_offs(level: str, setting: SamplingParams, expected: set[int]) -> None:
    logits = torch.tensor([[math.log(p) for p in PROBS]])
    assert _kept(_kernels(level), logits, setting) == expected


@pytest.mark.parametrize("level", LEVELS)
def test_ties_with_the_cut_off_are_kept_and_masked_tokens_never_drawn(level: str) -> None:
    kernels = _kernels(level)
    tied = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    assert _kept(kernels, tied, SamplingParams(top_k=2)) == {0, 1, 2, 3}
    masked = torch.tensor([[0.0, NEG_INF, 0.0, NEG_INF]])
    assert _kept(kernels, masked, SamplingParams()) == {0, 2}
    last = torch.tensor([1.0 - 2**-24])  # the largest uniform below 1
    assert _sample(kernels, masked, [SamplingParams()], last).tolist() == [2]
    every = torch.full((1, 7), NEG_INF)
    assert _sample(kernels, every, [SamplingParams()], torch.tensor([0.5])).tolist() == [0]


@pytest.mark.parametrize("level", LEVELS)
def test_rows_are_independent_of_the_thread_count(level: str) -> None:
    kernels = _kernels(level)
    logits = _rows(64, 2000, seed=3)
    params = [SETTINGS[i % len(SETTINGS)] for i in range(64)]
    uniform = torch.rand(64, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _sample(kernels, logits, params, uniform)
        torch.set_num_threads(max(threads, 2))
        shared = _sample(kernels, logits, params, uniform)
        first = _sample(kernels, logits[:1], params[:1], uniform[:1])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, shared)
    assert first.tolist() == alone[:1].tolist()


@pytest.mark.parametrize("level", LEVELS)
def test_bad_arguments_are_refused(level: str) -> None:
    kernels = _kernels(level)
    logits = torch.zeros(1, 5)
    good = SamplingParams()
    with pytest.raises(ValueError, match="out of range"):
        _sample(kernels, logits, [good], torch.tensor([1.0]))  # uniform must stay below 1
    with pytest.raises(ValueError, match="out of range"):
        kernels.sample(
            logits,
            torch.tensor([0.0]),  # temperature 0 is greedy, never sampled
            torch.tensor([0]),
            torch.tensor([1.0]),
            torch.tensor([0.0]),
            torch.tensor([0.5]),
        )
    with pytest.raises(ValueError, match="float32"):
        _sample(kernels, logits.double(), [good], torch.tensor([0.5]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        kernels.token_logprobs(logits, torch.tensor([5]), 1)


@pytest.mark.parametrize("level", LEVELS)
def test_logprobs_ranks_and_top_against_float64(level: str) -> None:
    kernels = _kernels(level)
    logits = _rows(40, 3000, seed=11)
    logits[0, :4] = 30.0  # ties at the top: the lower id first
    chosen = torch.randint(0, 3000, (40,), generator=torch.Generator().manual_seed(12))
    chosen[::3] = logits[::3].argmax(dim=-1)
    chosen[1] = int(torch.isinf(logits[1]).nonzero()[0])  # a masked token: -inf, ranked last
    got = kernels.token_logprobs(logits, chosen, 20)
    exact = torch.log_softmax(logits.double(), dim=-1)  # [40, vocab]
    expected = exact.gather(1, chosen[:, None])[:, 0]
    torch.testing.assert_close(got.logprob.double(), expected, atol=1e-5, rtol=0)
    for i in range(0, 40, 3):  # ranks and top are counted on the values the kernel reports
        row_logprobs = kernels.token_logprobs(
            logits[i : i + 1].expand(3000, -1).contiguous(), torch.arange(3000), 0
        ).logprob  # [vocab]: every token's reported logprob
        assert got.rank[i] == 1 + int((row_logprobs > got.logprob[i]).sum())
        order = sorted(range(3000), key=lambda t: (-row_logprobs[t].item(), t))[:20]
        assert got.top_ids[i].tolist() == order
        assert torch.equal(got.top_logprobs[i], row_logprobs[order])
    assert got.top_ids[0, :4].tolist() == [0, 1, 2, 3]
    assert got.logprob[1] == NEG_INF and got.rank[1] == 1 + int(torch.isfinite(logits[1]).sum())
    none = kernels.token_logprobs(logits, chosen, 0)
    assert none.top_ids.shape == (40, 0) and torch.equal(none.logprob, got.logprob)
