"""Fused RMSNorm, optionally with the residual add that precedes it in a decoder layer.

``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, computed in float32 and
rounded once to the input dtype. With ``residual``: ``h = x + residual`` (rounded to the input
dtype, as the unfused ``hidden = hidden + attn`` would be) is returned alongside ``rms_norm(h)``.
One program normalizes one row; the whole hidden dimension fits one tile.
"""

import torch

from splitserve.kernels.triton_utils import (
    FLOAT_DTYPES,
    check_last_dim_contiguous,
    check_launch,
    check_tensor,
    jit,
    launch,
    next_power_of_2,
    tl,
)


@jit
def _rms_norm_kernel(
    x_ptr,  # [rows, hidden]
    residual_ptr,  # [rows, hidden] (with HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr,  # [rows, hidden] contiguous
    residual_out_ptr,  # [rows, hidden] contiguous (with HAS_RESIDUAL)
    eps,
    stride_x_row,
    stride_residual_row,
    HIDDEN: tl.constexpr,
    HIDDEN_PAD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, HIDDEN_PAD)
    mask = columns < HIDDEN
    x = tl.load(x_ptr + row * stride_x_row + columns, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual_row + columns, mask=mask, other=0.0)
        summed = (x + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * HIDDEN + columns, summed, mask=mask)
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, 0) / HIDDEN
    weight = tl.load(weight_ptr + columns, mask=mask, other=0.0).to(tl.float32)
    out = x * tl.rsqrt(variance + eps) * weight  # [HIDDEN_PAD]
    tl.store(out_ptr + row * HIDDEN + columns, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [rows, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [rows, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(x)`` ``[rows, hidden]``, or ``(rms_norm(x + residual), x + residual)``.

    Outputs are new contiguous tensors in ``x``'s dtype; ``weight`` may have any float dtype.
    """
    check_tensor("x", x, (None, None), FLOAT_DTYPES)
    rows, hidden = x.shape
    check_tensor("weight", weight, (hidden,), FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        check_tensor("residual", residual, (rows, hidden), (x.dtype,))
        check_last_dim_contiguous("residual", residual)
        tensors["residual"] = residual
    check_launch(_rms_norm_kernel, "rms_norm", tensors)
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else out
    if rows:
        launch(
            _rms_norm_kernel, (rows,),
            x, residual if residual is not None else x, weight, out, residual_out, eps,
            x.stride(0), residual.stride(0) if residual is not None else 0,
            HIDDEN=hidden, HIDDEN_PAD=next_power_of_2(hidden), HAS_RESIDUAL=residual is not None,
        )  # fmt: skip
    return out if residual is None else (out, residual_out)


def rms_norm_ref(
    x: torch.Tensor,  # [rows, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``rms_norm``."""
    if residual is not None:
        summed = (x.float() + residual.float()).to(x.dtype)
        return rms_norm_ref(summed, weight, eps), summed
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed.to(x.dtype)
