"""The fused C++ kernels, at every level this CPU executes: residual add + RMSNorm against
torch's bf16 ops and HF's float32 formula, the rotary embedding against torch's ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.model import rms_norm
from splitserve.engine.model_config import RopeScaling
from splitserve.engine.rotary import apply_rotary, cos_sin_table
from splitserve.kernels.cpu_fused_ops import CpuFusedOps, load_cpu_fused_ops
from tests.kernel_levels import level_params, require_level


def _ops(level: str | None = None) -> CpuFusedOps:
    """The ops at ``level`` (None: the level chosen for this CPU); installed with the package,
    so a missing library fails the test."""
    if level is not None:
        require_level(level)
    ops = load_cpu_fused_ops(level)
    assert ops is not None, f"fused_ops at {level or 'the chosen level'}"
    return ops


@pytest.mark.parametrize("level", level_params("fused_ops"))
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 splits rows across threads
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch(level, rows, with_delta) -> None:
    ops = _ops(level)
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


@pytest.mark.parametrize("level", level_params("fused_ops"))
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_delta", [True, False])
def test_float32_add_rms_norm_is_hfs_formula_but_for_the_order_of_its_sum(
    level, rows, with_delta
) -> None:
    ops = _ops(level)
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
    ops = _ops()
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


@pytest.mark.parametrize("level", level_params("fused_ops"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
@pytest.mark.parametrize("tokens", [1, 7, 300])  # 300 tokens split across threads
def test_rotary_is_torchs_bit_for_bit_on_a_view_of_the_qkv_rows(level, dtype, tokens) -> None:
    """The model's case: query and key heads (12 of 64 dims) viewed out of fused qkv rows,
    against ``apply_rotary`` on the same view with the model's cos/sin tables."""
    ops = _ops(level)
    generator = torch.Generator().manual_seed(tokens)
    heads, kv_heads, head_dim = 9, 3, 64
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator) * 3).to(
        dtype
    )
    query_key = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    cos_table, sin_table = cos_sin_table(
        head_dim, 100000.0, RopeScaling(), 4096, dtype, torch.device("cpu")
    )
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    cos, sin = cos_table[positions], sin_table[positions]
    expected = apply_rotary(query_key, cos, sin)
    rotated = ops.rotary(query_key, cos, sin)
    assert rotated.is_contiguous() and rotated.shape == expected.shape
    assert torch.equal(rotated, expected)


def test_rotary_rejects_layouts_it_cannot_read() -> None:
    ops = _ops()
    x = torch.zeros(2, 3, 8)
    table = torch.zeros(2, 8)
    with pytest.raises(ValueError):
        ops.rotary(x.transpose(1, 2).contiguous().transpose(1, 2), table, table)  # heads apart
    with pytest.raises(ValueError):
        ops.rotary(x, table.bfloat16(), table.bfloat16())  # dtypes differ
    with pytest.raises(ValueError):
        ops.rotary(torch.zeros(2, 3, 7), torch.zeros(2, 7), torch.zeros(2, 7))  # odd head_dim
    with pytest.raises(ValueError):
        ops.rotary(x, torch.zeros(3, 8), table)


@pytest.mark.parametrize("level", level_params("fused_ops"))
@pytest.mark.parametrize("rows", [1, 5, 40])  # 40 x 1536 splits rows across threads
def test_silu_mul_is_torchs_formula_within_an_ulp_or_two(level, rows) -> None:
    """``silu(gate) * up`` against torch's ops in float64 (the exact value): float32 within a
    few ulps, bf16 within one bf16 ulp of torch's bf16 ops; the gate's extremes (exp's clamp,
    zeros, large magnitudes) included."""
    ops = _ops(level)
    generator = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, generator=generator) * 6
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.5, -88.5])
    exact = F.silu(gate_up[:, :1536].double()) * gate_up[:, 1536:].double()
    out = ops.silu_mul(gate_up)
    assert out.shape == (rows, 1536) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), exact, rtol=4e-7, atol=1e-30)
    bf16 = gate_up.bfloat16()
    expected = F.silu(bf16[:, :1536]) * bf16[:, 1536:]
    torch.testing.assert_close(ops.silu_mul(bf16), expected, rtol=2**-7, atol=1e-30)
    with pytest.raises(ValueError, match="even width"):
        ops.silu_mul(gate_up[:, :3])
