"""Matrix-vector products for the model's projections, with CPU weight prepacking.

``Linear(weight, bias)`` computes ``x @ weight.T + bias`` for ``x`` ``[tokens, in]``. On CPU in
bfloat16 it stores the weight in oneDNN's blocked layout once at load time; that avoids the
per-call reorder that ``F.linear`` pays and reads weights closer to memory bandwidth (measured
here: 22 GB/s vs 15 GB/s over a SmolLM2-sized decode step). Everywhere else (float32, CUDA) it
is plain ``F.linear``.

With ``SPLITSERVE_DECODE_GEMV=1`` (off by default), steps of at most
``kernels/cpu_gemv.py:MAX_ROWS`` rows (bf16 on CPU: decode steps, short prompt chunks, the LM
head's rows) go through the C++ GEMV (``kernels/cpu/gemv.cpp``) when it
can be built here: it streams each weight once with a software prefetch, where oneDNN's GEMV
restarts the prefetcher's stream per matrix and slows with every row (one core, SmolLM2's 121
matrices: 7.2-7.5 ms against 8.8-9.0 for one row, 7.4-7.9 against 12.2-12.8 for 8, 21.9
against 24.8 for 32). Such a weight is held twice, in oneDNN's layout for larger steps and in
the GEMV's (269 MB more for SmolLM2-135M). Why it is off by default: oneDNN's bf16 results
for a row are the same whatever the step's row count, so a prompt's tail computed after a
cached prefix (a few rows) gives the bits of the whole prompt computed at once; the GEMV sums
in another order (an ulp apart), and on a bf16 logit tie that picks another token (seen:
"What is the capital of France?" answered "L'Étoile..." instead of "The capital...").

Batch invariance in float32 on CPU: the BLAS picks a different kernel (and so a different
summation order) for 1, for 2-4 and for 5 or more rows, so a request's logits would depend on
how many other requests share its step, and greedy output can flip on the model's narrower
margins. Inputs with fewer than ``MIN_GEMM_ROWS`` rows are padded with zero rows, so every row
always goes through the same kernel: float32 results are identical whatever the batch.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from splitserve.kernels.cpu_gemv import MAX_ROWS, CpuGemv, GemvWeight, load_cpu_gemv

DECODE_GEMV_ENV = "SPLITSERVE_DECODE_GEMV"
"""``1``: projections of steps of at most ``MAX_ROWS`` rows use the C++ GEMV (see above)."""
MIN_GEMM_ROWS = 8
"""Float32 CPU inputs are padded to at least this many rows (see the module docstring)."""


def _prepacking_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear:
    """A projection ``[tokens, in] -> [tokens, out]`` with a fixed weight ``[out, in]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # [out, in]
        self.bias = bias  # [out] or None
        self.prepacked = (
            weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16
            and _prepacking_available()
        )
        self._gemv: CpuGemv | None = None
        self._gemv_weight: GemvWeight | None = None
        gemv_wanted = os.environ.get(DECODE_GEMV_ENV, "0") == "1"
        if gemv_wanted and self.prepacked and CpuGemv.supports(weight):
            self._gemv = load_cpu_gemv()
            if self._gemv is not None:
                self._gemv_weight = self._gemv.pack(weight)
        if self.prepacked:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.pad_rows = weight.device.type == "cpu" and weight.dtype == torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._gemv_weight is not None and 0 < x.shape[0] <= MAX_ROWS:
            assert self._gemv is not None
            return self._gemv(x, self._gemv_weight, self.bias)
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        rows = x.shape[0]
        if self.pad_rows and rows < MIN_GEMM_ROWS:
            padded = x.new_zeros(MIN_GEMM_ROWS, x.shape[1])  # [MIN_GEMM_ROWS, in]
            padded[:rows] = x
            return F.linear(padded, self.weight, self.bias)[:rows]
        return F.linear(x, self.weight, self.bias)
