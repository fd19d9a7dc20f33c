"""The fused residual-add + RMSNorm C++ kernel against torch's bf16 ops and HF's float32 formula,
both builds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.model import rms_norm
from splitserve.kernels.cpu_build import NATIVE_FLAGS, PORTABLE_FLAGS
from splitserve.kernels.cpu_fused_ops import CpuFusedOps, load_cpu_fused_ops


def _ops(flags: tuple[str, ...]) -> CpuFusedOps:
    ops = load_cpu_fused_ops(flags)
    if ops is None:
        pytest.skip("no C++ compiler here")
    return ops


@pytest.mark.parametrize("flags", [NATIVE_FLAGS, PORTABLE_FLAGS], ids=["native", "portable"])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 splits rows across threads
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch(flags, rows, with_delta) -> None:
    ops = _ops(flags)
    generator = torch.Generator().manual_seed(rows)
    hidden = (torch.randn(rows, 576, generator=generator) * 4).bfloat16()
    delta = torch.randn(rows, 576, generator=generator).bfloat16() if with_delta else None
    weight = torch.randn(576, generator=generator).bfloat16()
    expected_hidden = hidden + delta if with_delta else hidden.clone()
    expected = F.rms_norm(expected_hidden, (576,), weight, 1e-5)
    normed = ops.add_rms_norm(hidden, delta, weight, 1e-5)
    assert torch.equal(hidden, expected_hidden)  # the add is torch's, bit for bit, in place
    # float32 statistics summed in another order: at most one bf16 ulp apart, rarely
    torch.testing.assert_close(normed, expected, atol=0.0, rtol=2**-7)
    assert (normed != expected).float().mean() < 1e-3


@pytest.mark.parametrize("flags", [NATIVE_FLAGS, PORTABLE_FLAGS], ids=["native", "portable"])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_delta", [True, False])
def test_float32_add_rms_norm_is_hfs_formula_but_for_the_order_of_its_sum(
    flags, rows, with_delta
) -> None:
    ops = _ops(flags)
    generator = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, 576, generator=generator) * 4
    delta = torch.randn(rows, 576, generator=generator) if with_delta else None
    weight = torch.randn(576, generator=generator)
    expected_hidden = hidden + delta if with_delta else hidden.clone()
    expected = rms_norm(expected_hidden, weight, 1e-5)  # HF's, op for op
    normed = ops.add_rms_norm(hidden, delta, weight, 1e-5)
    assert torch.equal(hidden, expected_hidden)
    # the mean of squares summed in another order: a few float32 ulps at most
    torch.testing.assert_close(normed, expected, atol=0.0, rtol=2**-21)


def test_add_rms_norm_rejects_bad_layouts() -> None:
    ops = _ops(NATIVE_FLAGS)
    hidden = torch.zeros(4, 8, dtype=torch.bfloat16)
    weight = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        ops.add_rms_norm(hidden.float(), None, weight, 1e-5)  # dtypes differ
    with pytest.raises(ValueError):
        ops.add_rms_norm(hidden.half(), None, weight.half(), 1e-5)
    with pytest.raises(ValueError):
        ops.add_rms_norm(hidden.t(), None, torch.ones(4, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError):
        ops.add_rms_norm(hidden, torch.zeros(4, 9, dtype=torch.bfloat16), weight, 1e-5)
    with pytest.raises(ValueError):
        ops.add_rms_norm(hidden, None, torch.ones(9, dtype=torch.bfloat16), 1e-5)
