"""The C++ CPU attention kernels and the "cpu" attention backend built on them.

The decode kernel is checked against dense attention over the same (randomly scattered)
blocks, at every level this CPU executes (AVX2; AVX-512; its bf16 vector paths at AVX-512
BF16), in float32 and bf16; the bf16 causal prefill kernel
(AVX-512 BF16 only) against dense causal attention; bad arguments raise instead of reading
out of bounds; the backend matches the torch backend on a mixed decode + prefill step.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels.attention import SequenceSpan, TorchAttentionBackend
from splitserve.kernels.cpu_attention import (
    CpuDecodeAttention,
    CpuPrefillAttention,
    load_cpu_decode_attention,
    load_cpu_prefill_attention,
)
from splitserve.kernels.cpu_backend import CpuAttentionBackend
from tests.kernel_levels import level_params, require_level

BLOCK = 16
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _kernel(level: str | None = None) -> CpuDecodeAttention:
    """The kernel at ``level`` (None: the level chosen for this CPU); it is installed with the
    package, so a missing library fails the test."""
    if level is not None:
        require_level(level)
    kernel = load_cpu_decode_attention(level)
    assert kernel is not None, f"paged_decode_attention at {level or 'the chosen level'}"
    return kernel


def _dense_decode(query, keys, values, scale):
    """query [heads, dim], keys/values [ctx, kv_heads, dim] -> [heads, dim] (float64)."""
    group = query.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)  # [ctx, heads, dim]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,khd->hk", query.double(), k) * scale
    return torch.einsum("hk,khd->hd", scores.softmax(-1), v)


def _scattered_cache(context_lens, kv_heads, dim, dtype, generator, block=BLOCK):
    """A cache whose sequences own random, non-adjacent blocks; returns the dense KV too."""
    blocks_per_seq = [-(-n // block) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 5
    order = torch.randperm(num_blocks, generator=generator).tolist()
    key_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=generator).to(dtype)
    value_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=generator).to(dtype)
    width = max(blocks_per_seq)
    tables = torch.zeros(len(context_lens), width, dtype=torch.int64)
    dense = []
    for seq, (length, count) in enumerate(zip(context_lens, blocks_per_seq, strict=True)):
        ids = [order.pop() for _ in range(count)]
        tables[seq, :count] = torch.tensor(ids)
        keys = key_cache[ids].flatten(0, 1)[:length]
        values = value_cache[ids].flatten(0, 1)[:length]
        dense.append((keys, values))
    return key_cache, value_cache, tables, dense


@pytest.mark.parametrize("level", level_params("paged_decode_attention"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block"),
    [
        (9, 3, 64, BLOCK),  # SmolLM2-135M; bf16 AVX-512: register accumulators
        (9, 3, 64, 7),  # blocks that 16-token score groups straddle
        (4, 4, 32, BLOCK),  # one query head per KV head
        (24, 8, 128, BLOCK),  # head_dim 128, 3 query heads per KV head: registers
        (16, 4, 128, BLOCK),  # 4 per KV head at 128: AVX-512 generic path, AVX2 registers
        (14, 2, 64, BLOCK),  # 7 per KV head at 64: AVX-512 generic path, AVX2 registers
        (18, 2, 64, BLOCK),  # 9 per KV head: generic path at every level
        (8, 2, 48, BLOCK),  # head_dim not a multiple of 32: scalar loops
    ],
)
def test_kernel_matches_dense_attention(level, dtype, heads, kv_heads, dim, block) -> None:
    kernel = _kernel(level)
    generator = torch.Generator().manual_seed(heads * 100 + dim + block)
    context_lens = [1, 15, 16, 17, 31, 200, 333]
    key_cache, value_cache, tables, dense = _scattered_cache(
        context_lens, kv_heads, dim, dtype, generator, block
    )
    # A strided query, as sliced from a fused qkv projection.
    fused = torch.randn(len(context_lens), heads + 2, dim, generator=generator).to(dtype)
    query = fused[:, :heads]
    out = torch.full((len(context_lens), heads, dim), float("nan"), dtype=dtype)
    scale = dim**-0.5
    lens = torch.tensor(context_lens, dtype=torch.int64)
    kernel(out, query, key_cache, value_cache, tables, lens, scale)
    for seq, (keys, values) in enumerate(dense):
        expected = _dense_decode(query[seq], keys, values, scale)
        torch.testing.assert_close(
            out[seq].double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
        )


@pytest.mark.parametrize("level", level_params("paged_decode_attention"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_result_does_not_depend_on_the_batch(level, dtype) -> None:
    kernel = _kernel(level)
    generator = torch.Generator().manual_seed(7)
    lens_list = [40, 300, 5, 129]
    key_cache, value_cache, tables, _ = _scattered_cache(lens_list, 3, 64, dtype, generator)
    query = torch.randn(4, 9, 64, generator=generator).to(dtype)
    lens = torch.tensor(lens_list)
    batched = torch.empty_like(query)
    kernel(batched, query, key_cache, value_cache, tables, lens, 0.125)
    for seq in range(4):
        alone = torch.empty_like(query[seq : seq + 1])
        kernel(alone, query[seq : seq + 1], key_cache, value_cache, tables[seq : seq + 1],
               lens[seq : seq + 1], 0.125)  # fmt: skip
        assert torch.equal(alone[0], batched[seq])


def test_kernel_rejects_arguments_it_cannot_trust() -> None:
    kernel = _kernel()
    key_cache = torch.zeros(8, BLOCK, 2, 32)
    value_cache = torch.zeros(8, BLOCK, 2, 32)
    query = torch.zeros(2, 4, 32)
    out = torch.empty_like(query)
    tables = torch.tensor([[0, 1], [2, 3]])
    ok_lens = torch.tensor([20, 32])
    kernel(out, query, key_cache, value_cache, tables, ok_lens, 1.0)  # fine
    cases = [
        (tables, torch.tensor([20, 33])),  # longer than its two blocks
        (tables, torch.tensor([0, 5])),  # empty context
        (torch.tensor([[0, 1], [2, 8]]), ok_lens),  # block 8 of 8
        (torch.tensor([[0, -1], [2, 3]]), ok_lens),
        (tables.int(), ok_lens),  # int32 tables
    ]
    for bad_tables, bad_lens in cases:
        with pytest.raises(ValueError):
            kernel(out, query, key_cache, value_cache, bad_tables, bad_lens, 1.0)
    with pytest.raises(ValueError):  # dtype mismatch
        kernel(out, query.bfloat16(), key_cache, value_cache, tables, ok_lens, 1.0)
    with pytest.raises(ValueError):  # 4 heads over 3 KV heads
        kernel(torch.empty(2, 4, 32), query, torch.zeros(8, BLOCK, 3, 32),
               torch.zeros(8, BLOCK, 3, 32), tables, ok_lens, 1.0)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_matches_torch_backend_on_a_mixed_step(dtype) -> None:
    kernel = _kernel()
    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, num_blocks = 9, 3, 64, 40
    # (query_len, context_len): three decodes, a fresh prefill, a chunk after a cached prefix.
    shapes = [(1, 37), (1, 1), (1, 16), (12, 12), (6, 40)]
    tables = [[5, 9, 30], [2], [11], [0], [7, 3, 21]]
    key_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=generator).to(dtype)
    value_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=generator).to(dtype)
    tokens = sum(q for q, _ in shapes)
    query = torch.randn(tokens, heads, dim, generator=generator).to(dtype)
    key = torch.randn(tokens, kv_heads, dim, generator=generator).to(dtype)
    value = torch.randn(tokens, kv_heads, dim, generator=generator).to(dtype)
    spans = [SequenceSpan(q, c, t) for (q, c), t in zip(shapes, tables, strict=True)]
    outputs = []
    cpu_backend = CpuAttentionBackend(kernel, num_blocks, load_cpu_prefill_attention())
    for backend in (TorchAttentionBackend(), cpu_backend):
        caches = (key_cache.clone(), value_cache.clone())
        metadata = backend.prepare(spans, 3, BLOCK, torch.device("cpu"))
        outputs.append(backend.forward(query, key, value, *caches, metadata, dim**-0.5))
        assert torch.equal(caches[0][21, 7], key[-1])  # the chunk's last key landed
    torch.testing.assert_close(outputs[1], outputs[0], atol=TOLERANCE[dtype], rtol=0.0)


def _prefill_kernel() -> CpuPrefillAttention:
    kernel = load_cpu_prefill_attention()
    if kernel is None:
        pytest.skip("this CPU has no AVX-512 BF16 (or no C++ compiler)")
    return kernel


def _dense_causal(query, keys, values, scale):
    """query [q, heads, dim] at the end of keys/values [ctx, kv_heads, dim] -> float64."""
    query_len, context_len = query.shape[0], keys.shape[0]
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    positions = torch.arange(context_len - query_len, context_len)[:, None]
    scores = scores.masked_fill(torch.arange(context_len)[None, :] > positions, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    ("query_len", "context_len"),
    [(1, 1), (1, 40), (5, 5), (16, 16), (37, 37), (100, 300), (256, 256), (130, 1000), (601, 601)],
)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128), (2, 1, 256)]
)
def test_prefill_kernel_matches_dense_causal_attention(
    query_len, context_len, heads, kv_heads, dim
) -> None:
    kernel = _prefill_kernel()
    generator = torch.Generator().manual_seed(query_len * 1000 + context_len)
    # keys and values as strided views of one fused projection, as the model passes them
    fused = torch.randn(context_len, heads + 2 * kv_heads, dim, generator=generator).bfloat16()
    keys, values = fused[:, heads : heads + kv_heads], fused[:, heads + kv_heads :]
    query = torch.randn(query_len, heads, dim, generator=generator).bfloat16()
    out = kernel(query, keys, values, dim**-0.5)
    expected = _dense_causal(query, keys, values, dim**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


def test_prefill_kernel_rejects_what_it_cannot_take() -> None:
    kernel = _prefill_kernel()
    keys = torch.zeros(8, 2, 32, dtype=torch.bfloat16)
    query = torch.zeros(4, 4, 32, dtype=torch.bfloat16)
    for bad in (
        (torch.zeros(9, 4, 32, dtype=torch.bfloat16), keys, keys),  # more queries than context
        (query, keys, torch.zeros(7, 2, 32, dtype=torch.bfloat16)),  # value length differs
        (torch.zeros(4, 3, 32, dtype=torch.bfloat16), keys, keys),  # 3 heads over 2 KV heads
        (query.float(), keys.float(), keys.float()),  # float32 is not supported
        (torch.zeros(4, 4, 48, dtype=torch.bfloat16),) + (torch.zeros(8, 2, 48).bfloat16(),) * 2,
    ):
        with pytest.raises(ValueError):
            kernel(*bad, 1.0)
