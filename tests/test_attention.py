"""Torch paged-attention backend against a naive dense reference (small random shapes)."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels.attention import SequenceSpan, TorchAttentionBackend

HEADS, KV_HEADS, DIM, BLOCK, BLOCKS = 6, 2, 16, 4, 32


def _reference(query, keys, values, context_len, query_len):
    """Dense causal attention of the last ``query_len`` positions; [query_len, heads, dim]."""
    group = HEADS // KV_HEADS
    k = keys[:context_len].repeat_interleave(group, dim=1)  # [ctx, heads, dim]
    v = values[:context_len].repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, k) * DIM**-0.5
    positions = torch.arange(context_len - query_len, context_len)[:, None]
    scores = scores.masked_fill(torch.arange(context_len)[None, :] > positions, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_mixed_decode_and_prefill_with_cached_prefix(batch_invariant: bool) -> None:
    torch.manual_seed(0)
    # (query_len, context_len): two decodes, one fresh prefill, one chunk after a cached prefix.
    shapes = [(1, 9), (1, 4), (7, 7), (5, 13)]
    tables = [[3, 7, 1], [5], [0, 2], [9, 4, 8, 6]]
    key_cache = torch.zeros(BLOCKS, BLOCK, KV_HEADS, DIM)
    value_cache = torch.zeros(BLOCKS, BLOCK, KV_HEADS, DIM)
    full_keys, full_values, queries = [], [], []
    for (query_len, context_len), table in zip(shapes, tables, strict=True):
        keys = torch.randn(context_len, KV_HEADS, DIM)
        values = torch.randn(context_len, KV_HEADS, DIM)
        for pos in range(context_len - query_len):  # the cached prefix is already in the cache
            key_cache[table[pos // BLOCK], pos % BLOCK] = keys[pos]
            value_cache[table[pos // BLOCK], pos % BLOCK] = values[pos]
        full_keys.append(keys)
        full_values.append(values)
        queries.append(torch.randn(query_len, HEADS, DIM))
    backend = TorchAttentionBackend(batch_invariant=batch_invariant)
    spans = [SequenceSpan(q, c, t) for (q, c), t in zip(shapes, tables, strict=True)]
    metadata = backend.prepare(spans, num_decode=2, block_size=BLOCK, device=torch.device("cpu"))
    new_keys = torch.cat([k[c - q :] for k, (q, c) in zip(full_keys, shapes, strict=True)])
    new_values = torch.cat([v[c - q :] for v, (q, c) in zip(full_values, shapes, strict=True)])
    output = backend.forward(
        torch.cat(queries), new_keys, new_values, key_cache, value_cache, metadata, DIM**-0.5
    )  # [tokens, heads * dim]
    start = 0
    for index, (query_len, context_len) in enumerate(shapes):
        expected = _reference(
            queries[index], full_keys[index], full_values[index], context_len, query_len
        )
        got = output[start : start + query_len].view(query_len, HEADS, DIM)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        start += query_len
    # New keys landed in their slots.
    table, (query_len, context_len) = tables[3], shapes[3]
    last = context_len - 1
    torch.testing.assert_close(key_cache[table[last // BLOCK], last % BLOCK], full_keys[3][last])
