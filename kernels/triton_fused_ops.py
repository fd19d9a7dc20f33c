"""A decoder layer's elementwise steps on CUDA in reduced precision, one Triton kernel each.

``LlamaModel`` on CUDA in bf16 or fp16 takes these instead of torch's ops (``engine/model.py``):
the residual add with the RMSNorm after it (``kernels/rms_norm.py``), the rotary embedding of
queries and keys together, in place (``kernels/rotary.py``), and SiLU times up
(``kernels/activation.py``): three launches where torch's ops take at least nine, which matters
where a decode step's kernels are launched back to back (a CUDA graph replays them all; each
costs its launch and a pass over a few KB). Each computes in float32 and rounds once, so its
bits differ from HF's op-by-op rounding in bf16; float32 keeps HF's ops (the exactness
reference). Every kernel here is checked against its torch reference on CUDA
(``tests/test_gpu_kernels.py``) and, under the interpreter, on the CPU.
"""

from __future__ import annotations

import torch

from splitserve.kernels.activation import silu_and_mul
from splitserve.kernels.rms_norm import rms_norm
from splitserve.kernels.rotary import rotary_embedding

FUSED_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes the model runs these kernels in (float32 keeps HF's ops)."""


class TritonFusedOps:
    """The fused steps of one model with ``q_heads`` query heads."""

    def __init__(self, q_heads: int) -> None:
        self.q_heads = q_heads

    def add_rms_norm(
        self,
        hidden: torch.Tensor,  # [tokens, hidden]
        delta: torch.Tensor | None,  # [tokens, hidden]
        weight: torch.Tensor,  # [hidden]
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden + delta, rms_norm(hidden + delta) * weight)``, new tensors; no add when
        ``delta`` is None (``hidden`` itself is returned)."""
        if delta is None:
            normed = rms_norm(hidden, weight, eps)
            assert isinstance(normed, torch.Tensor)
            return hidden, normed
        normed, summed = rms_norm(delta, weight, eps, residual=hidden)
        return summed, normed

    def rotary(
        self,
        query_key: torch.Tensor,  # [tokens, q_heads + kv_heads, head_dim], a view of qkv
        cos: torch.Tensor,  # [max_positions, head_dim]: the whole table
        sin: torch.Tensor,  # [max_positions, head_dim]
        positions: torch.Tensor,  # [tokens] int64
    ) -> torch.Tensor:
        """Rotate every head of ``query_key`` in place by its token's position; returns it."""
        rotary_embedding(
            query_key[:, : self.q_heads], query_key[:, self.q_heads :], cos, sin, positions
        )
        return query_key

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [tokens, 2 * inter] -> [tokens, inter]
        """``silu(gate) * up``, a new tensor."""
        return silu_and_mul(gate_up)
