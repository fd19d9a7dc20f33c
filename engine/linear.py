"""Matrix-vector products for the model's projections, with CPU weight prepacking.

``Linear(weight, bias)`` computes ``x @ weight.T + bias`` for ``x`` ``[tokens, in]``. On CPU in
bfloat16 it stores the weight in oneDNN's blocked layout once at load time; that avoids the
per-call reorder that ``F.linear`` pays and reads weights closer to memory bandwidth (measured
here: 22 GB/s vs 15 GB/s over a SmolLM2-sized decode step). Everywhere else (float32, CUDA) it
is plain ``F.linear``.

Generated tokens' rows go through the C++ GEMV (``kernels/cpu/gemv.cpp``, bf16 on CPU,
when it can be built here; ``SPLITSERVE_DECODE_GEMV=0`` turns it off): it streams each weight
once with a software prefetch, where oneDNN's GEMV restarts the prefetcher's stream per matrix
and slows with every row (one core, SmolLM2's 121 matrices: 7.2-7.5 ms against 8.8-9.0 for
one row, 7.4-7.9 against 12.2-12.8 for 8, 21.9 against 24.8 for 32). Such a weight is held
twice, in oneDNN's layout for prompt rows and in the GEMV's (269 MB more for SmolLM2-135M).

Which rows take which path is fixed by the row's kind, never by the step's size, so a row's
bits do not depend on what shares its step: the caller names the leading ``generated_rows`` of
``x`` (one-token decode chunks); those go through the GEMV, in calls of at most ``MAX_ROWS``
rows (a GEMV row's sums do not depend on the other rows), and every prompt row goes through
oneDNN, whose bf16 result for a row is the same whatever the step's row count. So a prompt's
tail computed after a cached prefix gives the bits of the whole prompt computed at once; the
GEMV sums in another order than oneDNN (an ulp apart), and letting it take a short prompt tail
once flipped a bf16 logit tie ("What is the capital of France?" answered "L'Étoile..." on its
cached second ask). A generated token's KV recomputed as part of a prompt (a request resumed
elsewhere) goes through oneDNN, so in bf16 its bits may differ by an ulp from the first
computation; float32 never takes the GEMV.

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
"""``0``: generated tokens' rows use oneDNN too, not the C++ GEMV (see above); on by default."""
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
        gemv_wanted = os.environ.get(DECODE_GEMV_ENV, "1") != "0"
        if gemv_wanted and self.prepacked and CpuGemv.supports(weight):
            self._gemv = load_cpu_gemv()
            if self._gemv is not None:
                self._gemv_weight = self._gemv.pack(weight)
        if self.prepacked:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.pad_rows = weight.device.type == "cpu" and weight.dtype == torch.float32

    def __call__(self, x: torch.Tensor, generated_rows: int = 0) -> torch.Tensor:
        """``x @ weight.T + bias`` for ``x`` ``[tokens, in]``; the leading ``generated_rows``
        rows are generated tokens (they take the GEMV where it is loaded, see above)."""
        if self._gemv_weight is None or generated_rows <= 0:
            return self._dense(x)
        assert self._gemv is not None
        bias = self.bias
        parts = [
            self._gemv(x[start : min(start + MAX_ROWS, generated_rows)], self._gemv_weight, bias)
            for start in range(0, generated_rows, MAX_ROWS)
        ]  # each [<= MAX_ROWS, out]
        if generated_rows < x.shape[0]:
            parts.append(self._dense(x[generated_rows:]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN (prepacked bf16) or ``F.linear`` for all rows of ``x``."""
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        rows = x.shape[0]
        if self.pad_rows and rows < MIN_GEMM_ROWS:
            padded = x.new_zeros(MIN_GEMM_ROWS, x.shape[1])  # [MIN_GEMM_ROWS, in]
            padded[:rows] = x
            return F.linear(padded, self.weight, self.bias)[:rows]
        return F.linear(x, self.weight, self.bias)
