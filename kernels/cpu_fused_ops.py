"""Fused bf16 elementwise ops of the decoder layer on the CPU (``cpu/fused_ops.cpp``).

``CpuFusedOps`` wraps the compiled library: the residual add and the RMSNorm after it in one
pass. It checks the shapes, dtypes and layouts the C side trusts and raises ``ValueError``
otherwise. It rounds where torch's bf16 ops round (see the C++ contract): the sum is identical
to torch's, the norm within one bf16 ulp (float summation order). ``load_cpu_fused_ops``
returns None (logging why) when the library cannot be built or ``SPLITSERVE_CPU_KERNELS=0``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from splitserve.kernels.cpu_build import NATIVE_FLAGS, load_library

_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "splitserve_add_rms_norm_bf16": [_P, _P, _P, _P, _I, _I, _F, _T],
}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_bf16_matrix(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.bfloat16 and tensor.dim() == 2 and tensor.is_contiguous()


class CpuFusedOps:
    """The fused kernels as tensor functions (bf16, CPU, torch's intra-op thread count)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        for symbol, argtypes in _SIGNATURES.items():
            function = getattr(library, symbol)
            function.argtypes = argtypes
            function.restype = ctypes.c_int
        self._library = library

    def add_rms_norm(
        self,
        hidden: torch.Tensor,  # [tokens, hidden] bf16, updated in place when delta is given
        delta: torch.Tensor | None,  # [tokens, hidden] bf16
        weight: torch.Tensor,  # [hidden] bf16
        eps: float,
    ) -> torch.Tensor:
        """``hidden += delta`` (in place), then return ``rms_norm(hidden) * weight``."""
        _require(_is_bf16_matrix(hidden), "add_rms_norm: hidden must be contiguous 2-d bf16")
        rows, cols = hidden.shape
        _require(
            delta is None or (_is_bf16_matrix(delta) and delta.shape == hidden.shape),
            "add_rms_norm: delta must match hidden",
        )
        _require(
            weight.dtype == torch.bfloat16 and weight.shape == (cols,) and weight.is_contiguous(),
            "add_rms_norm: weight must be contiguous bf16 [hidden]",
        )
        out = torch.empty_like(hidden)
        status = self._library.splitserve_add_rms_norm_bf16(
            hidden.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            cols,
            eps,
            torch.get_num_threads(),
        )
        _require(status == 0, f"add_rms_norm kernel refused its arguments ({status})")
        return out


@functools.cache
def load_cpu_fused_ops(flags: tuple[str, ...] = NATIVE_FLAGS) -> CpuFusedOps | None:
    """The compiled fused ops, or None (logged) if disabled or they cannot be built here."""
    library = load_library("fused_ops", flags)
    return None if library is None else CpuFusedOps(library)
