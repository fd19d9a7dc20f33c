"""SiLU-and-multiply, the gated MLP's activation: ``silu(gate) * up``.

The input is the fused gate/up projection ``[rows, 2 * inter]`` (gate first, as
``gate_up(x).chunk(2, dim=-1)`` splits it); computed in float32, rounded once.
"""

import torch

from splitserve.kernels.triton_utils import (
    FLOAT_DTYPES,
    cdiv,
    check_last_dim_contiguous,
    check_launch,
    check_tensor,
    jit,
    launch,
    next_power_of_2,
    tl,
)

MAX_TILE = 1024


@jit
def _silu_and_mul_kernel(
    x_ptr,  # [rows, 2 * inter]
    out_ptr,  # [rows, inter] contiguous
    inter,
    stride_x_row,
    TILE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = columns < inter
    gate = tl.load(x_ptr + row * stride_x_row + columns, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x_row + inter + columns, mask=mask, other=0.0)
    out = gate * tl.sigmoid(gate) * up.to(tl.float32)
    tl.store(out_ptr + row * inter + columns, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [rows, 2 * inter] -> [rows, inter]
    """``silu(x[:, :inter]) * x[:, inter:]`` as a new contiguous tensor in ``x``'s dtype."""
    check_tensor("x", x, (None, None), FLOAT_DTYPES)
    rows, width = x.shape
    if width % 2:
        raise ValueError(f"`x` last dimension must be even (gate and up halves), got {width}")
    check_last_dim_contiguous("x", x)
    check_launch(_silu_and_mul_kernel, "silu_and_mul", {"x": x})
    inter = width // 2
    out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    tile = min(MAX_TILE, next_power_of_2(inter))
    if rows and inter:
        grid = (rows, cdiv(inter, tile))
        launch(_silu_and_mul_kernel, grid, x, out, inter, x.stride(0), TILE=tile)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of ``silu_and_mul``."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
