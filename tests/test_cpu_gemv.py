"""The bf16 GEMV C++ kernel (decode-step projections), both its AVX-512 loop and, where this
CPU has it, its AMX tiles, against float64 products, their batch invariance, what it refuses,
the float32 levels' refusal, and ``Linear`` sending exactly the generated rows it is told of
through it (prompt rows through oneDNN), with the same results within bf16 rounding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from splitserve.engine import linear as linear_module
from splitserve.engine.linear import (
    DECODE_GEMV_ENV,
    GEMV_PROBE_ROWS,
    Linear,
    decode_gemv_setting,
    measure_gemv_row_limit,
)
from splitserve.kernels.cpu_build import load_library
from splitserve.kernels.cpu_gemv import AMX_INPUTS, MAX_ROWS, CpuGemv, load_cpu_gemv
from tests.kernel_levels import runnable


def _kernel() -> CpuGemv:
    kernel = load_cpu_gemv()
    if kernel is None:
        pytest.skip("this CPU has no AVX-512 BF16 (or no C++ compiler)")
    return kernel


@pytest.fixture(params=["avx512", "amx"])
def each_kernel(request: pytest.FixtureRequest) -> CpuGemv:
    """The AVX-512 loop for every weight, then the kernel as loaded with AMX asked for
    (skipped where this CPU or Linux has no AMX)."""
    _kernel()
    library = load_library("gemv")
    assert library is not None
    kernel = CpuGemv(library, amx=request.param == "amx")
    if request.param == "amx" and not kernel.amx:
        pytest.skip("this CPU has no AMX (or Linux did not grant it)")
    return kernel


def _bf16_ulps_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Within float32-accumulation noise plus one bf16 rounding of the result."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.double(), expected, atol=scale * 2**-8, rtol=2**-7)


@pytest.mark.parametrize("rows", [*range(1, 10), 16, 17, MAX_ROWS])  # groups of 8 and a rest
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (576, 1536), (32, 6)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_float64_products(
    each_kernel: CpuGemv, rows, out_features, in_features, with_bias
) -> None:
    kernel = each_kernel
    generator = torch.Generator().manual_seed(rows * 7 + in_features)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16() if with_bias else None
    out = kernel(x, kernel.pack(weight), bias)
    expected = x.double() @ weight.double().T
    if bias is not None:
        expected += bias.double()
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    _bf16_ulps_close(out, expected)


def test_a_rows_result_does_not_depend_on_the_other_rows(each_kernel: CpuGemv) -> None:
    kernel = each_kernel
    generator = torch.Generator().manual_seed(3)
    weight = kernel.pack(torch.randn(3072, 576, generator=generator).bfloat16())
    x = torch.randn(MAX_ROWS, 576, generator=generator).bfloat16()
    for float_out in (False, True):
        together = kernel(x, weight, float_out=float_out)
        for row in range(MAX_ROWS):
            alone = kernel(x[row : row + 1], weight, float_out=float_out)
            assert torch.equal(alone, together[row : row + 1])
        for rows in (slice(2, 13), slice(5, 22), slice(16, 32)):  # within and across tiles
            assert torch.equal(kernel(x[rows], weight, float_out=float_out), together[rows])


def test_with_amx_a_weight_keeps_one_kernel_whatever_the_row_count() -> None:
    """With AMX granted, weights of whole tiles of inputs take AMX at every row count and the
    others the AVX-512 loop; the two sum in other orders, so their bits may differ by an ulp,
    and each agrees with float64 products."""
    kernel = _kernel()
    if not kernel.amx:
        pytest.skip("this CPU has no AMX (or Linux did not grant it)")
    library = load_library("gemv")
    assert library is not None
    loop = CpuGemv(library, amx=False)
    assert not loop.amx and loop.available
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(576, 1536, generator=generator).bfloat16()
    packed, odd_width = kernel.pack(weight), kernel.pack(weight[:, : AMX_INPUTS + 2])
    assert kernel.uses_amx(packed) and not kernel.uses_amx(odd_width)
    assert not loop.uses_amx(packed)
    x = torch.randn(MAX_ROWS, 1536, generator=generator).bfloat16()
    tiles, loop_sums = kernel(x, packed, float_out=True), loop(x, packed, float_out=True)
    expected = x.double() @ weight.double().T
    torch.testing.assert_close(tiles.double(), expected, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(loop_sums.double(), expected, atol=1e-3, rtol=1e-5)
    narrow = x[:, : AMX_INPUTS + 2].contiguous()
    assert torch.equal(kernel(narrow, odd_width), loop(narrow, odd_width))  # both the loop


def test_gemv_refuses_what_it_cannot_take() -> None:
    kernel = _kernel()
    weight = kernel.pack(torch.zeros(32, 8, dtype=torch.bfloat16))
    for bad_x in (
        torch.zeros(MAX_ROWS + 1, 8, dtype=torch.bfloat16),  # too many rows
        torch.zeros(0, 8, dtype=torch.bfloat16),  # none
        torch.zeros(1, 6, dtype=torch.bfloat16),  # wrong width
        torch.zeros(1, 8),  # float32
    ):
        with pytest.raises(ValueError, match="gemv"):
            kernel(bad_x, weight)
    with pytest.raises(ValueError, match="bias"):
        kernel(torch.zeros(1, 8, dtype=torch.bfloat16), weight, torch.zeros(16).bfloat16())
    for bad_weight in (
        torch.zeros(32, 8),  # float32
        torch.zeros(20, 8, dtype=torch.bfloat16),  # outputs not a multiple of 16
        torch.zeros(32, 7, dtype=torch.bfloat16),  # an odd number of inputs
    ):
        with pytest.raises(ValueError, match="gemv"):
            kernel.pack(bad_weight)


def test_the_float32_levels_have_no_gemv() -> None:
    """The avx2 and avx512 builds have no bf16 dot products: the loader refuses them (their
    CPUs keep oneDNN, or refuse bf16 altogether: ``engine/device.py:cpu_bf16_refusal``)."""
    levels = [level for level in ("avx2", "avx512") if runnable(level)]
    if not levels:
        pytest.skip("this CPU executes neither level")
    for level in levels:
        assert load_cpu_gemv(level) is None


def test_linear_sends_generated_rows_through_the_gemv_and_prompt_rows_through_onednn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernel = _kernel()
    monkeypatch.delenv(DECODE_GEMV_ENV, raising=False)  # on by default
    generator = torch.Generator().manual_seed(5)
    weight = (torch.randn(576, 1536, generator=generator) * 0.05).bfloat16()
    linear = Linear(weight)
    assert linear._gemv_weight is not None
    generated = MAX_ROWS + 4  # two GEMV calls
    x = torch.randn(generated + 40, 1536, generator=generator).bfloat16()
    expected = x.double() @ weight.double().T
    mixed = linear(x, generated)
    assert torch.equal(mixed[:MAX_ROWS], kernel(x[:MAX_ROWS], linear._gemv_weight))
    assert torch.equal(
        mixed[MAX_ROWS:generated], kernel(x[MAX_ROWS:generated], linear._gemv_weight)
    )
    prompt_only = linear(x)  # no generated rows: oneDNN for every row
    assert torch.equal(mixed[generated:], prompt_only[generated:])
    assert torch.equal(prompt_only[-5:], linear(x[-5:]))  # a prompt tail: the bits of the whole
    _bf16_ulps_close(mixed, expected)
    _bf16_ulps_close(prompt_only, expected)
    # the two paths differ only by float32 summation order and one bf16 rounding
    assert (mixed[:generated] != prompt_only[:generated]).float().mean() < 0.05


def test_linear_keeps_onednn_when_the_gemv_is_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DECODE_GEMV_ENV, "0")
    linear = Linear(torch.ones(32, 8, dtype=torch.bfloat16))
    assert linear._gemv_weight is None
    x = torch.ones(3, 8, dtype=torch.bfloat16)
    assert torch.equal(linear(x, 3), torch.full((3, 32), 8.0, dtype=torch.bfloat16))


def test_a_linear_for_an_engine_that_never_decodes_keeps_no_gemv_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``decode_gemv=False`` (a prefill-only worker) packs no GEMV copy of the weight, even
    where the GEMV would load; every row, generated or not, takes oneDNN's bits."""
    monkeypatch.delenv(DECODE_GEMV_ENV, raising=False)
    _kernel()
    generator = torch.Generator().manual_seed(6)
    weight = (torch.randn(576, 1536, generator=generator) * 0.05).bfloat16()
    with_gemv, prompt_only = Linear(weight), Linear(weight, decode_gemv=False)
    assert with_gemv._gemv_weight is not None and prompt_only._gemv_weight is None
    x = torch.randn(6, 1536, generator=generator).bfloat16()
    assert torch.equal(prompt_only(x, generated_rows=2), with_gemv(x))


def test_past_its_row_limit_a_step_takes_onednn_for_every_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``gemv_max_rows`` (what the model measured): a step with more generated rows than that
    computes all its rows through oneDNN; up to it, the generated rows keep the GEMV's bits."""
    monkeypatch.delenv(DECODE_GEMV_ENV, raising=False)
    kernel = _kernel()
    generator = torch.Generator().manual_seed(7)
    weight = (torch.randn(576, 1536, generator=generator) * 0.05).bfloat16()
    linear = Linear(weight)
    linear.gemv_max_rows = 2
    assert linear._gemv_weight is not None
    x = torch.randn(8, 1536, generator=generator).bfloat16()
    assert torch.equal(linear(x, 3), linear(x))  # 3 generated rows: past the limit
    within = linear(x, 2)
    assert torch.equal(within[:2], kernel(x[:2], linear._gemv_weight))
    assert torch.equal(within[2:], linear(x)[2:])


def test_the_row_limit_is_measured_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DECODE_GEMV_ENV, raising=False)
    _kernel()
    generator = torch.Generator().manual_seed(8)
    linears = [
        Linear((torch.randn(out, inp, generator=generator) * 0.05).bfloat16())
        for out, inp in [(2880, 576), (576, 1536)]
    ]
    limit = measure_gemv_row_limit(linears, repeats=3)
    assert limit is None or limit in GEMV_PROBE_ROWS  # at least one row
    assert all(linear.gemv_max_rows is None for linear in linears)  # it only measures


@pytest.mark.parametrize(
    ("slower_rounds", "limit", "rounds"),
    [
        ({}, None, len(GEMV_PROBE_ROWS)),  # never slower: no limit, one round per count
        ({4: [True, True]}, 2, 4),  # slower twice at 4 rows: the count before it
        ({4: [True, False]}, None, len(GEMV_PROBE_ROWS) + 1),  # a noisy first round only
        ({1: [True, True]}, 1, 2),  # slower at one row: still at least one
        ({2: [False], 16: [True, True]}, 8, 6),
    ],
)
def test_the_row_limit_needs_the_gemv_slower_in_two_rounds(
    monkeypatch: pytest.MonkeyPatch,
    slower_rounds: dict[int, list[bool]],
    limit: int | None,
    rounds: int,
) -> None:
    """The decision alone, on scripted timings: a row count limits the GEMV only where both
    of two rounds of its fastest passes find it over ``GEMV_SLOWER`` times oneDNN's."""
    calls: list[int] = []

    def scripted(linears: list, inputs: dict, rows: int, repeats: int) -> tuple[float, float]:
        slower = rows in slower_rounds and slower_rounds[rows][calls.count(rows)]
        calls.append(rows)
        return (1.2 if slower else 1.0), 1.0  # (GEMV s, oneDNN s)

    monkeypatch.setattr(linear_module, "_fastest_passes_s", scripted)
    assert measure_gemv_row_limit([SimpleNamespace(in_features=8)]) == limit
    assert len(calls) == rounds


@pytest.mark.parametrize(("value", "setting"), [(None, "auto"), ("", "auto"), ("AUTO", "auto"),
                                                ("1", "1"), ("0", "0")])  # fmt: skip
def test_the_gemv_setting_is_auto_by_default_and_refuses_what_it_cannot_read(
    monkeypatch: pytest.MonkeyPatch, value: str | None, setting: str
) -> None:
    if value is None:
        monkeypatch.delenv(DECODE_GEMV_ENV, raising=False)
    else:
        monkeypatch.setenv(DECODE_GEMV_ENV, value)
    assert decode_gemv_setting() == setting
    monkeypatch.setenv(DECODE_GEMV_ENV, "yes")
    with pytest.raises(ValueError, match="auto, 1 or 0"):
        decode_gemv_setting()


def test_logits_are_the_gemvs_float32_sums_for_every_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """The LM head (``logits=True``) keeps its rows in float32: the sums the bf16 GEMV rounds
    (rounding them gives its bf16 result bit for bit), row-invariant, for any row count past
    ``MAX_ROWS`` too, even where the decode GEMV is off or the engine never decodes."""
    kernel = _kernel()
    monkeypatch.setenv(DECODE_GEMV_ENV, "0")
    generator = torch.Generator().manual_seed(10)
    weight = (torch.randn(1024, 576, generator=generator) * 0.05).bfloat16()
    head = Linear(weight, decode_gemv=False, logits=True)
    assert head._gemv_weight is not None
    x = torch.randn(MAX_ROWS + 3, 576, generator=generator).bfloat16()
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (MAX_ROWS + 3, 1024)
    assert torch.equal(logits[:5].bfloat16(), kernel(x[:5], head._gemv_weight))
    assert torch.equal(head(x[-2:]), logits[-2:])  # a row's logits do not depend on the others
    expected = x.double() @ weight.double().T
    torch.testing.assert_close(logits.double(), expected, atol=1e-3, rtol=1e-3)
    # a step whose every chunk ends mid-prompt samples no row: no logits, not an error
    none = head(x[:0])
    assert none.dtype == torch.float32 and none.shape == (0, 1024)
