"""KV pack/unpack, RMSNorm (+ residual), rotary embedding and SiLU-and-mul against their torch
references, under Triton's CPU interpreter."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.model_config import RopeScaling
from splitserve.engine.rotary import apply_rotary, cos_sin_table
from splitserve.kernels.interpret import triton_interpreter

with triton_interpreter():  # triton and the kernels must first be imported in interpreter mode
    pytest.importorskip("triton")
    from splitserve.kernels import activation, kv_pack, rms_norm, rotary, triton_utils

TOLERANCES = {  # bf16: the interpreter truncates float32 -> bf16 (GPUs round to nearest)
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
DTYPES = list(TOLERANCES)


def _kv_cache(dtype: torch.dtype) -> torch.Tensor:
    """``[layers=4, 2, blocks=10, block_size=3, kv_heads=2, head_dim=8]`` random cache."""
    return torch.randn(4, 2, 10, 3, 2, 8).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layers", [None, [3, 1], [2]])
def test_pack_then_unpack_round_trip(dtype: torch.dtype, layers: list[int] | None) -> None:
    torch.manual_seed(0)
    kv = _kv_cache(dtype)
    block_ids = torch.tensor([7, 2, 9, 0], dtype=torch.int32)
    packed = kv_pack.pack_kv(kv, block_ids, layers)  # [layers, 2, ids, 3, 2, 8]
    assert packed.is_contiguous()
    assert torch.equal(packed, kv_pack.pack_kv_ref(kv, block_ids, layers))
    received = torch.randn_like(packed.float()).to(dtype)
    got, expected = kv.clone(), kv.clone()
    kv_pack.unpack_kv(received, got, block_ids, layers)
    kv_pack.unpack_kv_ref(received, expected, block_ids, layers)
    assert torch.equal(got, expected)
    assert torch.equal(kv_pack.pack_kv(got, block_ids, layers), received)


def test_pack_chunks_large_blocks_and_strided_layers() -> None:
    """A block larger than one program's chunk; a cache that is a view with a layer stride
    larger than its layer size (the block contents stay contiguous)."""
    torch.manual_seed(1)
    base = torch.randn(3, 2, 5, 32, 4, 40)  # block: 5120 elements > MAX_CHUNK
    kv = base[::2, :, 1:]  # [2, 2, 4, 32, 4, 40], non-contiguous layers and blocks
    block_ids = torch.tensor([3, 0])
    assert torch.equal(kv_pack.pack_kv(kv, block_ids), kv_pack.pack_kv_ref(kv, block_ids))


def test_pack_nothing() -> None:
    kv = _kv_cache(torch.float32)
    assert kv_pack.pack_kv(kv, torch.zeros(0, dtype=torch.int64), [1]).shape == (1, 2, 0, 3, 2, 8)
    assert kv_pack.pack_kv(kv, torch.tensor([1]), []).shape == (0, 2, 1, 3, 2, 8)


def test_pack_rejects_bad_inputs() -> None:
    kv = _kv_cache(torch.float32)
    with pytest.raises(ValueError, match=r"`layers` \[4\] out of range"):
        kv_pack.pack_kv(kv, torch.tensor([1]), [4])
    with pytest.raises(ValueError, match="`block_ids` must have dtype"):
        kv_pack.pack_kv(kv, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="last 3 dimensions contiguous"):
        kv_pack.pack_kv(kv.transpose(4, 5), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"`buffer` must have shape \[1, 2, 2, 3, 2, 8\]"):
        kv_pack.unpack_kv(torch.zeros(1, 2, 3, 3, 2, 8), kv, torch.tensor([1, 2]), [0])
    with pytest.raises(ValueError, match="`buffer` must have dtype"):
        kv_pack.unpack_kv(torch.zeros(1, 2, 1, 3, 2, 8).half(), kv, torch.tensor([1]), [0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype: torch.dtype, with_residual: bool) -> None:
    torch.manual_seed(2)
    x = torch.randn(6, 100).to(dtype)[:, :72]  # [rows, hidden=72]: padded tile, row stride 100
    weight = torch.randn(72).to(dtype)
    residual = torch.randn(6, 72).to(dtype) if with_residual else None
    got = rms_norm.rms_norm(x, weight, 1e-5, residual)
    expected = rms_norm.rms_norm_ref(x, weight, 1e-5, residual)
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


def test_rms_norm_matches_the_engine_in_float32() -> None:
    from splitserve.engine.model import rms_norm as engine_rms_norm

    torch.manual_seed(3)
    x, weight = torch.randn(3, 40), torch.randn(40)
    view = torch.randn(3, 80)[:, :40]  # strided rows
    torch.testing.assert_close(rms_norm.rms_norm(x, weight, 1e-6), engine_rms_norm(x, weight, 1e-6))
    torch.testing.assert_close(
        rms_norm.rms_norm(view, weight, 1e-6), engine_rms_norm(view, weight, 1e-6)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_reference_and_engine(dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    tokens, heads, kv_heads, head_dim = 5, 9, 3, 16
    cos, sin = cos_sin_table(head_dim, 10000.0, RopeScaling(), 64, dtype)  # [64, head_dim]
    positions = torch.tensor([0, 3, 63, 7, 7])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)  # fused projection
    query_key = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    engine = apply_rotary(query_key, cos[positions], sin[positions])  # before the in-place op
    query, key = query_key[:, :heads], query_key[:, heads:]  # strided views
    expected_query = rotary.rotary_embedding_ref(query, cos, sin, positions)
    expected_key = rotary.rotary_embedding_ref(key, cos, sin, positions)
    rotary.rotary_embedding(query, key, cos, sin, positions)
    torch.testing.assert_close(query, expected_query, **TOLERANCES[dtype])
    torch.testing.assert_close(key, expected_key, **TOLERANCES[dtype])
    loose = {"atol": 3e-2, "rtol": 3e-2} if dtype != torch.float32 else TOLERANCES[dtype]
    torch.testing.assert_close(query_key, engine, **loose)  # engine rounds per op


def test_rotary_rejects_bad_inputs() -> None:
    cos = sin = torch.ones(8, 16)
    query, key = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    with pytest.raises(ValueError, match="`key` must have dtype"):
        rotary.rotary_embedding(query, key.half(), cos, sin, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"`positions` must have shape \[2\]"):
        rotary.rotary_embedding(query, key, cos, sin, torch.tensor([0]))
    with pytest.raises(ValueError, match="head_dim must be even"):
        rotary.rotary_embedding(query[..., :15], key[..., :15], cos, sin, torch.tensor([0, 1]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    x = torch.randn(4, 2 * 40).to(dtype)  # [rows, 2 * inter]
    got = activation.silu_and_mul(x)  # [rows, inter]
    torch.testing.assert_close(got, activation.silu_and_mul_ref(x), **TOLERANCES[dtype])
    gate, up = x.float().chunk(2, dim=-1)
    loose = TOLERANCES[dtype] if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(got.float(), torch.nn.functional.silu(gate) * up, **loose)


def test_silu_and_mul_several_tiles_and_rejection() -> None:
    x = torch.randn(2, 2 * 1500)  # inter 1500 > one 1024 tile
    torch.testing.assert_close(activation.silu_and_mul(x), activation.silu_and_mul_ref(x))
    with pytest.raises(ValueError, match="must be even"):
        activation.silu_and_mul(torch.randn(2, 7))


def test_compiled_kernels_refuse_cpu_tensors() -> None:
    not_interpreted = object()  # what a compiled (JIT) kernel looks like to the check
    with pytest.raises(ValueError, match="`x` is on cpu; compiled Triton kernels need CUDA"):
        triton_utils.check_launch(not_interpreted, "rms_norm", {"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="must share one device"):
        triton_utils.check_launch(
            not_interpreted, "rms_norm", {"x": torch.zeros(1), "y": torch.zeros(1, device="meta")}
        )
