"""bf16 matrix products of a few rows on the CPU (``cpu/gemv.cpp``): a decode step's projections.

``CpuGemv.pack(weight)`` lays a ``[out, in]`` bf16 weight out once, at load time, as the kernel
reads it (``GemvWeight``); ``CpuGemv.__call__(x, packed, bias)`` computes ``x @ weight.T +
bias`` for ``x`` ``[rows, in]`` with ``rows <= MAX_ROWS``, streaming the weight from memory
once. It checks the shapes, dtypes and layouts the C side trusts and raises ``ValueError``
otherwise. ``load_cpu_gemv`` returns None (logging why) when the library cannot be built,
``SPLITSERVE_CPU_KERNELS=0``, or this CPU has no AVX-512 BF16.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from splitserve.kernels.cpu_build import NATIVE_FLAGS, load_library

logger = logging.getLogger(__name__)
MAX_ROWS = 32
"""The most rows one call takes (the C side's ``kMaxRows``)."""
OUT_BLOCK = 16
"""``out_features`` must be a multiple of this (outputs per accumulator register)."""
UNSUPPORTED = -2
"""What the kernel returns when built without AVX-512 BF16."""

_P, _I, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@dataclass(frozen=True)
class GemvWeight:
    """A weight packed for the kernel: ``data`` ``[out / 16, in / 2, 16, 2]`` bf16."""

    data: torch.Tensor
    out_features: int
    in_features: int


class CpuGemv:
    """The compiled kernel as tensor functions (bf16, CPU, torch's intra-op thread count)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._pack = library.splitserve_gemv_pack_bf16
        self._pack.argtypes = [_P, _P, _I, _I]
        self._pack.restype = ctypes.c_int
        self._gemv = library.splitserve_gemv_bf16
        self._gemv_f32 = library.splitserve_gemv_bf16_f32
        for function in (self._gemv, self._gemv_f32):
            function.argtypes = [_P, _P, _I, _P, _P, _I, _I, _T]
            function.restype = ctypes.c_int
        probe = self.pack(torch.zeros(OUT_BLOCK, 2, dtype=torch.bfloat16))
        status = self._run(torch.zeros(1, 2, dtype=torch.bfloat16), probe, None)[1]
        self.available = status != UNSUPPORTED
        """False when this CPU build has no AVX-512 BF16 path."""

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        """Whether ``pack`` takes this weight (else keep the caller's other path)."""
        out_features, in_features = weight.shape
        return (
            weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16
            and out_features % OUT_BLOCK == 0
            and in_features % 2 == 0
        )

    def pack(self, weight: torch.Tensor) -> GemvWeight:
        """``weight`` ``[out, in]`` bf16 in the kernel's layout (a copy)."""
        if weight.dim() != 2 or not self.supports(weight):
            raise ValueError("gemv: the weight must be 2-d CPU bf16, out % 16 == 0, in even")
        weight = weight.contiguous()
        out_features, in_features = weight.shape
        packed = torch.empty(
            out_features // OUT_BLOCK, in_features // 2, OUT_BLOCK, 2, dtype=torch.bfloat16
        )
        status = self._pack(packed.data_ptr(), weight.data_ptr(), out_features, in_features)
        if status != 0:
            raise ValueError(f"gemv: packing refused the weight (code {status})")
        return GemvWeight(packed, out_features, in_features)

    def __call__(
        self,
        x: torch.Tensor,  # [rows, in] bf16, rows <= MAX_ROWS
        weight: GemvWeight,
        bias: torch.Tensor | None = None,  # [out] bf16
        float_out: bool = False,
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` as ``[rows, out]`` bf16 (``float_out``: float32, the same
        sums unrounded); ``ValueError`` for what it cannot take."""
        if (
            x.dim() != 2
            or x.dtype != torch.bfloat16
            or x.device.type != "cpu"
            or x.shape[1] != weight.in_features
            or not 0 < x.shape[0] <= MAX_ROWS
        ):
            raise ValueError(f"gemv: x must be [1..{MAX_ROWS}, {weight.in_features}] CPU bf16")
        if bias is not None and (
            bias.dtype != torch.bfloat16
            or bias.shape != (weight.out_features,)
            or not bias.is_contiguous()
        ):
            raise ValueError(f"gemv: bias must be contiguous bf16 [{weight.out_features}]")
        out, status = self._run(x.contiguous(), weight, bias, float_out)
        if status != 0:
            raise ValueError(f"gemv: the kernel refused its arguments (code {status})")
        return out

    def _run(
        self,
        x: torch.Tensor,
        weight: GemvWeight,
        bias: torch.Tensor | None,
        float_out: bool = False,
    ) -> tuple[torch.Tensor, int]:
        dtype = torch.float32 if float_out else torch.bfloat16
        out = x.new_empty(x.shape[0], weight.out_features, dtype=dtype)  # [rows, out]
        status = (self._gemv_f32 if float_out else self._gemv)(
            out.data_ptr(),
            x.data_ptr(),
            x.shape[0],
            weight.data.data_ptr(),
            None if bias is None else bias.data_ptr(),
            weight.out_features,
            weight.in_features,
            torch.get_num_threads(),
        )
        return out, status


@functools.cache
def load_cpu_gemv(flags: tuple[str, ...] = NATIVE_FLAGS) -> CpuGemv | None:
    """The compiled kernel if it has its AVX-512 BF16 path here, else None."""
    library = load_library("gemv", flags)
    if library is None:
        return None
    kernel = CpuGemv(library)
    if not kernel.available:
        logger.info("CPU kernel gemv: this build has no AVX-512 BF16, using oneDNN")
        return None
    return kernel
