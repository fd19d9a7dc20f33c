"""The model's layer loop with the Triton fused steps (``kernels/triton_fused_ops.py``: add +
RMSNorm, rotary in place, SiLU * up), as CUDA runs it in bf16, against torch's ops on the same
weights and batch, on the CPU under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.model import LlamaModel
from splitserve.engine.random_checkpoint import SHAPES, random_checkpoint
from splitserve.kernels.attention import SequenceSpan, TorchAttentionBackend
from splitserve.kernels.interpret import triton_interpreter

with triton_interpreter():  # triton and the kernels must first be imported in interpreter mode
    pytest.importorskip("triton")
    from splitserve.kernels.triton_fused_ops import TritonFusedOps

BLOCK, BLOCKS = 16, 16


def _logits(model: LlamaModel, kv_cache: torch.Tensor) -> torch.Tensor:
    """A mixed batch (two decodes, then a 9-token prompt after a 3-token prefix) over
    ``kv_cache``; the float32 logits of its three sampled rows."""
    spans = [SequenceSpan(1, 5, [0]), SequenceSpan(1, 18, [1, 2]), SequenceSpan(9, 12, [3])]
    positions = [4, 17, *range(3, 12)]
    backend = TorchAttentionBackend()
    metadata = backend.prepare(spans, 2, BLOCK, torch.device("cpu"))
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(2, model.config.vocab_size, (len(positions),), generator=generator)
    return model.forward(
        ids, torch.tensor(positions), kv_cache, backend, metadata, torch.tensor([0, 1, 10])
    )


def _models(dtype: torch.dtype) -> tuple[LlamaModel, LlamaModel, torch.Tensor]:
    """The tiny shape's model with torch's ops and with the fused steps, on the same weights
    (drawn in bf16, so both dtypes hold the same values), and a KV cache of random values."""
    shape = SHAPES["tiny"]
    weights = random_checkpoint(shape, torch.bfloat16, "cpu", seed=2, std=0.3).weights
    plain = LlamaModel(shape, weights, dtype, torch.device("cpu"), 64, False)
    fused = LlamaModel(shape, weights, dtype, torch.device("cpu"), 64, False)
    plain._fused_ops = fused._fused_ops = None  # torch's ops, as on CUDA without these
    fused._gpu_ops = TritonFusedOps(shape.num_attention_heads)
    generator = torch.Generator().manual_seed(1)
    cache_shape = (shape.num_hidden_layers, 2, BLOCKS, BLOCK, shape.num_key_value_heads)
    cache = torch.randn(*cache_shape, shape.head_dim, generator=generator).to(torch.bfloat16)
    return plain, fused, cache.to(dtype)


def test_fused_steps_equal_torch_ops_in_float32() -> None:
    """Wiring: in float32 the fused steps give torch's logits and write the same (rotated)
    keys, within float32 rounding."""
    plain, fused, cache = _models(torch.float32)
    plain_cache, fused_cache = cache.clone(), cache.clone()
    expected, got = _logits(plain, plain_cache), _logits(fused, fused_cache)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused_cache, plain_cache, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_fused_steps_in_bf16_are_no_less_accurate() -> None:
    """In bf16 each fused step rounds once where torch's ops round after every op: against
    float32 on the same weights, the fused model's logits are no further off than the plain
    bf16 model's (with a margin for where rounding errors happen to cancel)."""
    reference = _logits(*_models(torch.float32)[::2])  # the plain model in float32
    plain, fused, cache = _models(torch.bfloat16)
    plain_error = (_logits(plain, cache.clone()) - reference).abs().max().item()
    fused_error = (_logits(fused, cache.clone()) - reference).abs().max().item()
    assert fused_error <= 1.25 * plain_error, (fused_error, plain_error)
