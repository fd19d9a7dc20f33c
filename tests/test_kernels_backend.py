"""The Triton attention backend against the torch backend on the engine's packed batch, on CPU
tensors under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels.attention import AttentionBackend, SequenceSpan, TorchAttentionBackend
from splitserve.kernels.interpret import triton_interpreter

with triton_interpreter():  # triton and the kernels must first be imported in interpreter mode
    pytest.importorskip("triton")
    from splitserve.kernels.triton_backend import TritonAttentionBackend

HEADS, KV_HEADS, DIM, BLOCK, BLOCKS = 9, 3, 16, 4, 40
TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 2e-2}

# (query_len, context_len) and block tables: two decodes (one on a block boundary, one of
# length 1), a fresh prompt, a chunk after a cached prefix, a one-token chunk after a prefix.
SHAPES = [(1, 9), (1, 8), (1, 1), (7, 7), (5, 13), (1, 6)]
TABLES = [[3, 7, 1], [5, 11], [12], [0, 2], [9, 4, 8, 6], [10, 13]]
NUM_DECODE = 3


def _run(
    backend: AttentionBackend, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer over the packed batch; returns (output [tokens, heads * dim], key, value cache)."""
    torch.manual_seed(seed)
    kv = torch.randn(2, 2, BLOCKS, BLOCK, KV_HEADS, DIM).to(dtype)  # engine layout, 2 layers
    key_cache, value_cache = kv[1, 0], kv[1, 1]
    tokens = sum(query_len for query_len, _ in SHAPES)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM).to(dtype)  # fused projection
    query = qkv[:, : HEADS * DIM].view(tokens, HEADS, DIM)  # strided views, as the model passes
    key = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(tokens, KV_HEADS, DIM)
    value = qkv[:, (HEADS + KV_HEADS) * DIM :].view(tokens, KV_HEADS, DIM)
    spans = [SequenceSpan(q, c, t) for (q, c), t in zip(SHAPES, TABLES, strict=True)]
    metadata = backend.prepare(spans, NUM_DECODE, BLOCK, torch.device("cpu"))
    output = backend.forward(query, key, value, key_cache, value_cache, metadata, DIM**-0.5)
    return output, key_cache, value_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_triton_backend_matches_torch_backend(dtype: torch.dtype, batch_invariant: bool) -> None:
    triton_out, triton_keys, triton_values = _run(TritonAttentionBackend(batch_invariant), dtype, 0)
    torch_out, torch_keys, torch_values = _run(TorchAttentionBackend(batch_invariant), dtype, 0)
    assert triton_out.shape == (sum(q for q, _ in SHAPES), HEADS * DIM)
    assert triton_out.dtype == dtype
    assert torch.equal(triton_keys, torch_keys)  # the new KV landed in the same slots
    assert torch.equal(triton_values, torch_values)
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(triton_out, torch_out, atol=tolerance, rtol=tolerance)


def test_triton_backend_prefill_only_and_decode_only_steps() -> None:
    backend = TritonAttentionBackend()
    for spans, num_decode in (
        ([SequenceSpan(3, 3, [4])], 0),
        ([SequenceSpan(1, 5, [4, 2]), SequenceSpan(1, 2, [7])], 2),
    ):
        metadata = backend.prepare(spans, num_decode, BLOCK, torch.device("cpu"))
        tokens = sum(span.query_len for span in spans)
        kv = torch.randn(2, BLOCKS, BLOCK, KV_HEADS, DIM)
        query = torch.randn(tokens, HEADS, DIM)
        key, value = torch.randn(tokens, KV_HEADS, DIM), torch.randn(tokens, KV_HEADS, DIM)
        expected_kv = kv.clone()
        torch_backend = TorchAttentionBackend()
        torch_metadata = torch_backend.prepare(spans, num_decode, BLOCK, torch.device("cpu"))
        expected = torch_backend.forward(
            query, key, value, expected_kv[0], expected_kv[1], torch_metadata, 0.25
        )
        got = backend.forward(query, key, value, kv[0], kv[1], metadata, 0.25)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
        assert torch.equal(kv, expected_kv)
