"""bf16 matrix products of a few rows on the CPU (``cpu/gemv.cpp``): a decode step's projections.

``CpuGemv.pack(weight)`` lays a ``[out, in]`` bf16 weight out once, at load time, as the kernel
reads it (``GemvWeight``); ``CpuGemv.__call__(x, packed, bias)`` computes ``x @ weight.T +
bias`` for ``x`` ``[rows, in]`` with ``rows <= MAX_ROWS``, streaming the weight from memory
once. It checks the shapes, dtypes and layouts the C side trusts and raises ``ValueError``
otherwise. ``load_cpu_gemv`` returns None (logging why) when the library is not installed or
does not load, ``SPLITSERVE_CPU_KERNELS=0``, or this CPU has no AVX-512 BF16.

Two kernels read the same packed weight. On a CPU with AMX (and a Linux that grants a process
its tile registers) a weight whose ``in_features`` is a multiple of 32 takes the AMX tiles:
one tile instruction multiplies 16 rows by 32 inputs x 16 outputs, so the call stays bound by
reading the weight at any row count. Elsewhere the AVX-512 BF16 loop, bound by its arithmetic
past a few rows. Measured on an Intel Xeon with AMX, one core, SmolLM2-135M's 121 matrices,
bf16 out: AMX 18.8 / 19.9 / 21.0 / 27.0 ms at 1 / 10 / 16 / 32 rows, the AVX-512 loop 23.3 /
31.5 / 45.4 / 86.4, oneDNN (prepacked) 36.7 / 24.9 / 25.6 / 29.2. Both kernels sum a row
independently of the other rows of its call, each in its own order (float32 sums that differ
in their last bits): which one a weight takes is fixed for the process (``uses_amx``), never
by the row count. The AMX entry points refuse (-3) until Linux granted the tiles, so a tile
instruction never runs without them (it would kill the process with SIGILL).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from splitserve.kernels.cpu_build import load_library

logger = logging.getLogger(__name__)
MAX_ROWS = 32
"""The most rows one call takes (the C side's ``kMaxRows``)."""
OUT_BLOCK = 16
"""``out_features`` must be a multiple of this (outputs per accumulator register)."""
UNSUPPORTED = -2
"""What the kernel returns when built without AVX-512 BF16 (or, for the AMX entry points,
without AMX)."""
AMX_INPUTS = 32
"""The AMX kernel takes weights whose ``in_features`` is a multiple of this (one tile's
inputs); others take the AVX-512 loop."""

_P, _I, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@dataclass(frozen=True)
class GemvWeight:
    """A weight packed for the kernel: ``data`` ``[out / 16, in / 2, 16, 2]`` bf16."""

    data: torch.Tensor
    out_features: int
    in_features: int


class CpuGemv:
    """The compiled kernel as tensor functions (bf16, CPU, torch's intra-op thread count)."""

    def __init__(self, library: ctypes.CDLL, amx: bool = True) -> None:
        """``amx=False``: the AVX-512 loop for every weight even where AMX is granted."""
        self._pack = library.splitserve_gemv_pack_bf16
        self._pack.argtypes = [_P, _P, _I, _I]
        self._pack.restype = ctypes.c_int
        self._gemv = library.splitserve_gemv_bf16
        self._gemv_f32 = library.splitserve_gemv_bf16_f32
        self._amx = library.splitserve_gemv_amx_bf16
        self._amx_f32 = library.splitserve_gemv_amx_bf16_f32
        for function in (self._gemv, self._gemv_f32, self._amx, self._amx_f32):
            function.argtypes = [_P, _P, _I, _P, _P, _I, _I, _T]
            function.restype = ctypes.c_int
        library.splitserve_gemv_amx_init.argtypes = []
        library.splitserve_gemv_amx_init.restype = ctypes.c_int
        self.amx = False
        probe = self.pack(torch.zeros(OUT_BLOCK, 2, dtype=torch.bfloat16))
        status = self._run(torch.zeros(1, 2, dtype=torch.bfloat16), probe, None)[1]
        self.available = status != UNSUPPORTED
        """False when this CPU build has no AVX-512 BF16 path."""
        self.amx = amx and self.available and library.splitserve_gemv_amx_init() == 0
        """Whether weights with ``in_features % AMX_INPUTS == 0`` take the AMX kernel: it
        was asked for, this build has AMX, and Linux granted this process the tiles."""

    def uses_amx(self, weight: GemvWeight) -> bool:
        """Whether this weight's products take the AMX kernel (fixed for the process)."""
        return self.amx and weight.in_features % AMX_INPUTS == 0

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
        if self.uses_amx(weight):
            function = self._amx_f32 if float_out else self._amx
        else:
            function = self._gemv_f32 if float_out else self._gemv
        status = function(
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
def load_cpu_gemv(level: str | None = None) -> CpuGemv | None:
    """The compiled kernel if it has its AVX-512 BF16 path here, else None."""
    library = load_library("gemv", level)
    if library is None:
        return None
    kernel = CpuGemv(library)
    if not kernel.available:
        logger.info("CPU kernel gemv: this build has no AVX-512 BF16, using oneDNN")
        return None
    logger.info("CPU kernel gemv: %s", "AMX tiles" if kernel.amx else "AVX-512 BF16 loop")
    return kernel
