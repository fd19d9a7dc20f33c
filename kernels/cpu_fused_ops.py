"""Fused elementwise ops of the decoder layer on the CPU (``cpu/fused_ops.cpp``).

``CpuFusedOps`` wraps the compiled library: the residual add and the RMSNorm after it in one
pass, the rotary embedding of a step's query and key heads in one call, and SiLU(gate) * up
over the fused gate_up projection's rows, bf16 or float32.
It checks the shapes, dtypes and layouts the C side trusts and raises ``ValueError``
otherwise. It rounds where torch's ops round (see the C++ contract): the sum is identical to
torch's; the norm is within one bf16 ulp of torch's fused bf16 one, and in float32 is HF's
formula but for how the squares are summed; the rotary embedding is torch's ops
(``engine/rotary.py:apply_rotary``) bit for bit; SiLU is torch's formula with an exp within
about an ulp (torch's own is another such approximation). ``load_cpu_fused_ops``
returns None (logging why) when the library is not installed or does not load or
``SPLITSERVE_CPU_KERNELS=0``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from splitserve.kernels.cpu_build import bind_functions, function_address, load_library, require

_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "splitserve_add_rms_norm_bf16": [_P, _P, _P, _P, _I, _I, _F, _T],
    "splitserve_add_rms_norm_f32": [_P, _P, _P, _P, _I, _I, _F, _T],
    "splitserve_rotary_bf16": [_P, _P, _I, _P, _P, _I, _I, _I, _T],
    "splitserve_rotary_f32": [_P, _P, _I, _P, _P, _I, _I, _I, _T],
    "splitserve_silu_mul_bf16": [_P, _P, _I, _I, _T],
    "splitserve_silu_mul_f32": [_P, _P, _I, _I, _T],
}
_ADD_RMS_NORM_OF = {
    torch.bfloat16: "splitserve_add_rms_norm_bf16",
    torch.float32: "splitserve_add_rms_norm_f32",
}
_ROTARY_OF = {torch.bfloat16: "splitserve_rotary_bf16", torch.float32: "splitserve_rotary_f32"}
_SILU_MUL_OF = {
    torch.bfloat16: "splitserve_silu_mul_bf16",
    torch.float32: "splitserve_silu_mul_f32",
}
_SYMBOLS_OF = {"add_rms_norm": _ADD_RMS_NORM_OF, "rotary": _ROTARY_OF, "silu_mul": _SILU_MUL_OF}
"""Each op's kernel for each dtype it takes."""


def _is_matrix(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return tensor.dtype == dtype and tensor.dim() == 2 and tensor.is_contiguous()


class CpuFusedOps:
    """The fused kernels as tensor functions (bf16 or float32, CPU, torch's intra-op thread
    count)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        bind_functions(library, _SIGNATURES)
        self._library = library

    def address(self, op: str, dtype: torch.dtype) -> int:
        """The C function of ``op`` (``add_rms_norm``, ``rotary``, ``silu_mul``) for ``dtype``,
        as an address (for ``kernels/cpu_decode_layers.py``, which calls it from C)."""
        return function_address(getattr(self._library, _SYMBOLS_OF[op][dtype]))

    def add_rms_norm(
        self,
        hidden: torch.Tensor,  # [tokens, hidden] bf16 or float32, updated in place with delta
        delta: torch.Tensor | None,  # [tokens, hidden], hidden's dtype
        weight: torch.Tensor,  # [hidden], hidden's dtype
        eps: float,
    ) -> torch.Tensor:
        """``hidden += delta`` (in place), then return ``rms_norm(hidden) * weight``."""
        dtype = hidden.dtype
        require(
            dtype in _ADD_RMS_NORM_OF and _is_matrix(hidden, dtype),
            "add_rms_norm: hidden must be contiguous 2-d bf16 or float32",
        )
        rows, cols = hidden.shape
        require(
            delta is None or (_is_matrix(delta, dtype) and delta.shape == hidden.shape),
            "add_rms_norm: delta must match hidden",
        )
        require(
            weight.dtype == dtype and weight.shape == (cols,) and weight.is_contiguous(),
            "add_rms_norm: weight must be contiguous [hidden] of hidden's dtype",
        )
        out = torch.empty_like(hidden)
        status = getattr(self._library, _ADD_RMS_NORM_OF[dtype])(
            hidden.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            cols,
            eps,
            torch.get_num_threads(),
        )
        require(status == 0, f"add_rms_norm kernel refused its arguments ({status})")
        return out

    def rotary(
        self,
        x: torch.Tensor,  # [tokens, heads, head_dim]: heads contiguous in a token, any token stride
        cos: torch.Tensor,  # [tokens, head_dim] contiguous, x's dtype
        sin: torch.Tensor,  # [tokens, head_dim] contiguous, x's dtype
    ) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` as a new contiguous ``[tokens, heads, head_dim]``
        tensor, equal bit for bit to ``engine/rotary.py:apply_rotary``."""
        require(x.dim() == 3 and x.dtype in _ROTARY_OF, "rotary: x must be 3-d bf16 or float32")
        tokens, heads, head_dim = x.shape
        require(
            x.stride(2) == 1 and x.stride(1) == head_dim and head_dim % 2 == 0,
            "rotary: each token's heads must be contiguous, head_dim even",
        )
        for table in (cos, sin):
            require(
                _is_matrix(table, x.dtype) and table.shape == (tokens, head_dim),
                "rotary: cos and sin must be contiguous [tokens, head_dim] of x's dtype",
            )
        out = torch.empty((tokens, heads, head_dim), dtype=x.dtype)
        status = getattr(self._library, _ROTARY_OF[x.dtype])(
            out.data_ptr(),
            x.data_ptr(),
            x.stride(0) if tokens > 1 else heads * head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            tokens,
            heads,
            head_dim,
            torch.get_num_threads(),
        )
        require(status == 0, f"rotary kernel refused its arguments ({status})")
        return out

    def silu_mul(
        self,
        gate_up: torch.Tensor,  # [tokens, 2 * intermediate] bf16 or float32, contiguous
    ) -> torch.Tensor:
        """``silu(gate) * up`` ``[tokens, intermediate]`` where ``gate, up =
        gate_up.chunk(2, -1)``; bf16 rounds the SiLU and the product, as torch's two ops."""
        dtype = gate_up.dtype
        require(
            dtype in _SILU_MUL_OF and _is_matrix(gate_up, dtype) and gate_up.shape[1] % 2 == 0,
            "silu_mul: gate_up must be contiguous 2-d bf16 or float32 of even width",
        )
        rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, cols)
        status = getattr(self._library, _SILU_MUL_OF[dtype])(
            out.data_ptr(), gate_up.data_ptr(), rows, cols, torch.get_num_threads()
        )
        require(status == 0, f"silu_mul kernel refused its arguments ({status})")
        return out


@functools.cache
def load_cpu_fused_ops(level: str | None = None) -> CpuFusedOps | None:
    """The compiled fused ops, or None (logged) if disabled or their library does not load here."""
    library = load_library("fused_ops", level)
    return None if library is None else CpuFusedOps(library)
