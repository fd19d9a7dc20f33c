"""Decode-step matrix products that read GGUF Q4_1 / Q8_0 weights as stored (``cpu/qgemv.cpp``).

``CpuQGemv.pack(blocks, ggml_type, out_features, in_features)`` lays a weight's GGUF blocks
(``[out, in / 32 * block_bytes]`` uint8, rows in the model's order) out once, at load, as the
kernel reads it (``QuantWeight``: the file's bytes per weight, 5 bits for Q4_1 and 8.5 for
Q8_0, against 16 in bf16); ``CpuQGemv.__call__(x, weight, bias, float_out)`` computes
``x @ W.T + bias`` for ``x`` ``[rows, in]`` bf16 or float32, ``rows <= MAX_ROWS``, where ``W``
holds exactly the float32 values gguf's dequantization gives (``d * q + m``, ``d * q``). It
checks what the C side trusts and raises ``ValueError`` otherwise. ``load_cpu_qgemv`` returns
None (logging why) when the library is not installed or does not load,
``SPLITSERVE_CPU_KERNELS=0``, or this CPU runs no level (AVX2 + FMA at least); below the
avx512_bf16 level (AVX2-only EPYCs, Skylake-SP, Cascade Lake) it reads float32 x only
(``CpuQGemv.reads``). ``CpuQGemv.unpack`` writes a weight's dense float32 values (gguf's
exactly) for the rows that take a dense product (``engine/linear.py``).

Sums (the C file's header has the details): a row's outputs never depend on the other rows of
its call. Float32 x: each weight dequantized to its float32 value, then fused multiply-adds,
so only the summation order differs from a float32 matmul over the dequantized weights. bf16
x: per 32-input block, ``d * sum(q * x)`` (Q4_1: ``+ m * sum(x)``), the block's products on
the integers q by vdpbf16ps: the file's weights exactly, rounded otherwise than the dense bf16
path, which rounds each weight to bf16 first.

Measured on the AMD EPYC (2 cores, AVX-512 BF16, no AMX), one core, SmolLM2-135M's 211 GGUF
matrices (210 Q4_1 projections unfused and the Q8_0 embedding as LM head), medians of 7, bf16
x, against the bf16 GEMV (``cpu_gemv.py``) on the widened weights in the same run: 6.6 against
12.8 ms at 1 row, 16.9 against 27.5 at 8, 32.1 against 39.1 at 16.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from splitserve.kernels.cpu_build import function_address, load_library

logger = logging.getLogger(__name__)
MAX_ROWS = 32
"""The most rows one call takes (the C side's ``kMaxRows``)."""
OUT_BLOCK = 16
"""``out_features`` must be a multiple of this."""
IN_BLOCK = 32
"""``in_features`` must be a multiple of this (one GGUF block)."""
UNSUPPORTED = -2
"""What the kernel returns when built with neither AVX-512 (F, BW) nor AVX2 + FMA."""
FLOAT32_ONLY = -3
"""What it returns for bf16 x or out when built without AVX-512 BF16 (avx2, avx512 levels)."""
Q4_1 = 3
Q8_0 = 8
SUPPORTED_TYPES = {Q4_1: "Q4_1", Q8_0: "Q8_0"}
"""ggml type id -> name, of the types the kernel reads."""
RAW_BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}
"""Bytes of one GGUF block of 32 weights."""

_P, _I, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@dataclass(frozen=True)
class QuantWeight:
    """A weight packed for the kernel: ``data`` the packed groups (uint8, the GGUF tensor's
    size), ``ggml_type`` one of ``SUPPORTED_TYPES``."""

    data: torch.Tensor
    ggml_type: int
    out_features: int
    in_features: int


class CpuQGemv:
    """The compiled kernel as tensor functions (CPU, torch's intra-op thread count)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._pack = library.splitserve_qgemv_pack
        self._pack.argtypes = [_P, _P, _T, _I, _I]
        self._pack.restype = ctypes.c_int
        self._bytes = library.splitserve_qgemv_packed_bytes
        self._bytes.argtypes = [_T, _I, _I]
        self._bytes.restype = ctypes.c_int64
        self._unpack = library.splitserve_qgemv_unpack
        self._unpack.argtypes = [_P, _P, _T, _I, _I, _T]
        self._unpack.restype = ctypes.c_int
        self._rows = library.splitserve_qgemv_rows
        self._rows.argtypes = [_P, _P, _T, _I, _I, _P, _I]
        self._rows.restype = ctypes.c_int
        self._run = library.splitserve_qgemv
        self._run.argtypes = [_P, _T, _P, _T, _I, _P, _T, _P, _I, _I, _T]
        self._run.restype = ctypes.c_int
        probe = self.pack(torch.zeros(OUT_BLOCK, RAW_BLOCK_BYTES[Q8_0], dtype=torch.uint8), Q8_0)
        out = torch.empty(1, OUT_BLOCK)
        status = self._run(
            out.data_ptr(), 1, torch.zeros(1, IN_BLOCK).data_ptr(), 1, 1,
            probe.data.data_ptr(), Q8_0, None, OUT_BLOCK, IN_BLOCK, 1,
        )  # fmt: skip
        self.available = status != UNSUPPORTED
        """False when this build has no row kernel at all (below AVX2 + FMA)."""
        status = self._run(
            out.data_ptr(), 1, torch.zeros(1, IN_BLOCK, dtype=torch.bfloat16).data_ptr(), 0, 1,
            probe.data.data_ptr(), Q8_0, None, OUT_BLOCK, IN_BLOCK, 1,
        )  # fmt: skip
        self.reads_bf16 = status not in (UNSUPPORTED, FLOAT32_ONLY)
        """Whether bf16 x (and bf16 out) are read: False below the avx512_bf16 level (AVX2-only
        EPYCs, Skylake-SP, Cascade Lake), which take float32 x and out only."""

    @property
    def address(self) -> int:
        """``splitserve_qgemv``'s address (for ``kernels/cpu_decode_layers.py``)."""
        return function_address(self._run)

    def reads(self, dtype: torch.dtype) -> bool:
        """Whether ``__call__`` takes x of this dtype on this CPU."""
        return dtype == torch.float32 or (dtype == torch.bfloat16 and self.reads_bf16)

    @staticmethod
    def supports(ggml_type: int, out_features: int, in_features: int) -> bool:
        """Whether ``pack`` takes a weight of this type and shape (else the dense path)."""
        return (
            ggml_type in SUPPORTED_TYPES
            and out_features > 0
            and out_features % OUT_BLOCK == 0
            and in_features > 0
            and in_features % IN_BLOCK == 0
        )

    def pack(self, blocks: torch.Tensor, ggml_type: int) -> QuantWeight:
        """``blocks`` ``[out, in / 32 * block_bytes]`` uint8 GGUF blocks in the kernel's layout
        (a copy)."""
        if blocks.dim() != 2 or blocks.dtype != torch.uint8 or ggml_type not in SUPPORTED_TYPES:
            raise ValueError("qgemv: blocks must be 2-d uint8 of a Q4_1 or Q8_0 tensor")
        block_bytes = RAW_BLOCK_BYTES[ggml_type]
        out_features, row_bytes = blocks.shape
        if row_bytes % block_bytes:
            raise ValueError(f"qgemv: a row of {row_bytes} bytes is not whole blocks")
        in_features = row_bytes // block_bytes * IN_BLOCK
        if not self.supports(ggml_type, out_features, in_features):
            raise ValueError("qgemv: out_features must be a multiple of 16, in_features of 32")
        blocks = blocks.contiguous()
        packed = torch.empty(self._bytes(ggml_type, out_features, in_features), dtype=torch.uint8)
        status = self._pack(
            packed.data_ptr(), blocks.data_ptr(), ggml_type, out_features, in_features
        )
        if status != 0:
            raise ValueError(f"qgemv: packing refused the weight (code {status})")
        return QuantWeight(packed, ggml_type, out_features, in_features)

    def unpack(self, weight: QuantWeight, out: torch.Tensor) -> torch.Tensor:
        """``weight``'s values into ``out`` (float32, contiguous, at least out x in elements)
        as a dense ``[out, in]`` view: exactly gguf's dequantized values (the widened
        weight's), so a dense product over it has the dense path's bits."""
        size = weight.out_features * weight.in_features
        if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < size:
            raise ValueError(f"qgemv: unpack needs {size} contiguous float32 elements")
        dense = out.view(-1)[:size].view(weight.out_features, weight.in_features)
        status = self._unpack(
            dense.data_ptr(), weight.data.data_ptr(), weight.ggml_type, weight.out_features,
            weight.in_features, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"qgemv: unpacking refused the weight (code {status})")
        return dense

    def rows(self, weight: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64, any shape) of ``weight`` as dense float32 ``[*ids.shape, in]``:
        the values ``unpack`` gives them (an embedding looked up in its blocks);
        ``ValueError`` for an id outside ``[0, out)``."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), weight.in_features)  # [n, in]
        status = self._rows(
            out.data_ptr(), weight.data.data_ptr(), weight.ggml_type, weight.out_features,
            weight.in_features, flat.data_ptr(), flat.numel(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"qgemv: rows refused (an id outside [0, {weight.out_features}))")
        return out.view(*ids.shape, weight.in_features)

    def __call__(
        self,
        x: torch.Tensor,  # [rows, in] bf16 or float32, rows <= MAX_ROWS
        weight: QuantWeight,
        bias: torch.Tensor | None = None,  # [out], x's dtype
        float_out: bool = False,
    ) -> torch.Tensor:
        """``x @ W.T + bias`` as ``[rows, out]`` in x's dtype (``float_out``: float32)."""
        if (
            x.dim() != 2
            or x.dtype not in (torch.bfloat16, torch.float32)
            or x.device.type != "cpu"
            or x.shape[1] != weight.in_features
            or not 0 < x.shape[0] <= MAX_ROWS
        ):
            raise ValueError(
                f"qgemv: x must be [1..{MAX_ROWS}, {weight.in_features}] CPU bf16 or float32"
            )
        if bias is not None and (
            bias.dtype != x.dtype
            or bias.shape != (weight.out_features,)
            or not bias.is_contiguous()
        ):
            raise ValueError(f"qgemv: bias must be contiguous [{weight.out_features}], x's dtype")
        x = x.contiguous()
        x_f32 = x.dtype == torch.float32
        out_dtype = torch.float32 if float_out else x.dtype
        out = x.new_empty(x.shape[0], weight.out_features, dtype=out_dtype)  # [rows, out]
        status = self._run(
            out.data_ptr(), int(out_dtype == torch.float32), x.data_ptr(), int(x_f32),
            x.shape[0], weight.data.data_ptr(), weight.ggml_type,
            None if bias is None else bias.data_ptr(), weight.out_features,
            weight.in_features, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"qgemv: the kernel refused its arguments (code {status})")
        return out


@functools.cache
def load_cpu_qgemv(level: str | None = None) -> CpuQGemv | None:
    """The compiled kernel at ``level`` (None: the level this CPU runs) if it has a row
    kernel there (float32 x at least: ``reads``), else None."""
    library = load_library("qgemv", level)
    if library is None:
        return None
    kernel = CpuQGemv(library)
    if not kernel.available:
        logger.info("CPU kernel qgemv: this build has no row kernel (below AVX2 + FMA)")
        return None
    if not kernel.reads_bf16:
        logger.info("CPU kernel qgemv: no AVX-512 BF16 at this level, float32 rows only")
    return kernel
