"""Matrix-vector products for the model's projections, with CPU weight prepacking.

``Linear(weight, bias)`` computes ``x @ weight.T + bias`` for ``x`` ``[tokens, in]``. On CPU in
bfloat16 it stores the weight in oneDNN's blocked layout once at load time; that avoids the
per-call reorder that ``F.linear`` pays and reads weights closer to memory bandwidth (measured
here: 22 GB/s vs 15 GB/s over a SmolLM2-sized decode step). Everywhere else (float32 for
bit-exact comparison with HF, CUDA) it is plain ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
        if self.prepacked:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
