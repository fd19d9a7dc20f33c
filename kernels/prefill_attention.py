"""Prefill attention over packed variable-length sequences and a paged KV cache.

The packed batch holds each sequence's new (query) tokens contiguously: sequence ``i`` owns
tokens ``query_start[i]:query_start[i + 1]``, which are the last ``query_len`` positions of its
``context_lens[i]`` tokens; query ``j`` sits at position ``context_len - query_len + j`` and
attends keys ``0..that position`` (causal, over the cached prefix and the new tokens).

``prefill_attention`` first stores the new keys and values into the paged cache
(``store_kv``), then ``context_attention`` reads every key from the cache
``[num_blocks, block_size, kv_heads, head_dim]`` through the block tables, so a chunk that
follows a cached prefix (prefix caching, chunked prefill) needs no gather. One program owns
``BLOCK_M`` queries of one head of one sequence; its KV head is ``head // (heads // kv_heads)``
(GQA). float16/bfloat16/float32 inputs, float32 accumulation. A sequence with no query tokens
(an empty slot) launches programs that return at once.
"""

import math

import torch

from splitserve.kernels.store_kv import store_kv
from splitserve.kernels.triton_utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    LOG2E,
    cdiv,
    check_last_dim_contiguous,
    check_launch,
    check_same_dtype,
    check_tensor,
    dot_precision,
    jit,
    launch,
    next_power_of_2,
    tl,
    upcast_dot,
)


@jit
def _context_attention_kernel(
    query_ptr,  # [tokens, heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache_ptr,  # same shape and strides as the key cache
    block_tables_ptr,  # [num_seqs, max_blocks]
    query_start_ptr,  # [num_seqs + 1]
    context_lens_ptr,  # [num_seqs]
    out_ptr,  # [tokens, heads, head_dim]
    qk_scale,  # softmax scale * log2(e)
    stride_query_token,
    stride_query_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    stride_out_token,
    stride_out_head,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    query_start = tl.load(query_start_ptr + seq).to(tl.int32)
    query_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - query_start
    if tile * BLOCK_M < query_len:
        context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
        prefix_len = context_len - query_len
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
        dims = tl.arange(0, HEAD_DIM_PAD)
        row_ok = rows < query_len
        dim_ok = dims < HEAD_DIM
        query_positions = prefix_len + rows  # [BLOCK_M]
        tokens = (query_start + rows).to(tl.int64)
        query_offsets = (
            tokens[:, None] * stride_query_token + head * stride_query_head + dims[None, :]
        )
        row_mask = row_ok[:, None] & dim_ok[None, :]
        query = tl.load(query_ptr + query_offsets, mask=row_mask, other=0.0)
        if UPCAST:
            query = query.to(tl.float32)  # [BLOCK_M, HEAD_DIM_PAD]

        kv_head = head // GROUP
        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
        key_end = tl.minimum(context_len, prefix_len + (tile + 1) * BLOCK_M)  # causal bound
        for start in range(0, key_end, BLOCK_N):
            positions = start + tl.arange(0, BLOCK_N)
            key_ok = positions < key_end
            block = tl.load(table_row + positions // BLOCK_SIZE, mask=key_ok, other=0)
            slots = block.to(tl.int64) * stride_cache_block
            slots += (positions % BLOCK_SIZE) * stride_cache_slot
            kv_offsets = slots[:, None] + kv_head * stride_cache_head + dims[None, :]
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            key = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [N, DIM_PAD]
            value = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
            if UPCAST:
                key = key.to(tl.float32)
                value = value.to(tl.float32)
            scores = tl.dot(query, tl.trans(key), input_precision=PRECISION) * qk_scale
            visible = key_ok[None, :] & (positions[None, :] <= query_positions[:, None])
            scores = tl.where(visible, scores, float("-inf"))  # [BLOCK_M, BLOCK_N]
            new_max = tl.maximum(row_max, tl.max(scores, 1))  # finite: key 0 is in tile 0
            correction = tl.exp2(row_max - new_max)
            probs = tl.exp2(scores - new_max[:, None])
            row_sum = row_sum * correction + tl.sum(probs, 1)
            acc = acc * correction[:, None] + tl.dot(
                probs.to(value.dtype), value, input_precision=PRECISION
            )
            row_max = new_max

        out = acc / row_sum[:, None]
        out_offsets = tokens[:, None] * stride_out_token + head * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    check_tensor("query", query, (None, None, None), FLOAT_DTYPES)
    heads, head_dim = query.shape[1], query.shape[2]
    check_tensor("key_cache", key_cache, (None, None, None, head_dim), FLOAT_DTYPES)
    check_same_dtype("key_cache", key_cache, "query", query.dtype)
    check_tensor("value_cache", value_cache, tuple(key_cache.shape), FLOAT_DTYPES)
    check_same_dtype("value_cache", value_cache, "query", query.dtype)
    if value_cache.stride() != key_cache.stride():
        raise ValueError(
            f"`value_cache` strides {value_cache.stride()} differ from `key_cache` strides "
            f"{key_cache.stride()}"
        )
    kv_heads = key_cache.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"`query` heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    check_tensor("context_lens", context_lens, (None,), INDEX_DTYPES)
    num_seqs = context_lens.shape[0]
    check_tensor("block_tables", block_tables, (num_seqs, None), INDEX_DTYPES)
    check_tensor("query_start", query_start, (num_seqs + 1,), INDEX_DTYPES)
    check_last_dim_contiguous("query", query)
    check_last_dim_contiguous("key_cache", key_cache)
    check_last_dim_contiguous("block_tables", block_tables)
    if not query_start.is_contiguous():
        raise ValueError("`query_start` must be contiguous")


def context_attention(
    query: torch.Tensor,  # [tokens, heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], context written
    value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    query_start: torch.Tensor,  # [num_seqs + 1] int32/int64, query_start[0] == 0
    context_lens: torch.Tensor,  # [num_seqs] int32/int64, >= each sequence's query_len
    scale: float,
    *,
    max_query_len: int | None = None,
    block_m: int | None = None,
    block_n: int = 32,
    out: torch.Tensor | None = None,  # [tokens, heads, head_dim], query's dtype
) -> torch.Tensor:
    """Causal attention of packed queries over contexts already in the paged cache.

    Returns ``[tokens, heads, head_dim]`` in the query's dtype; rows of tokens outside every
    ``query_start`` range are left unwritten. The caller guarantees monotone ``query_start``
    ending at ``tokens``, contexts within the block tables and valid block ids.
    ``max_query_len`` (an upper bound of the query lengths) avoids a device sync;
    ``block_m``/``block_n`` (queries per program, keys per loop step: powers of two >= 16)
    override the tiles.
    """
    _check_inputs(query, key_cache, value_cache, block_tables, query_start, context_lens)
    tokens, heads, head_dim = query.shape
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    check_tensor("out", out, tuple(query.shape), (query.dtype,))
    check_last_dim_contiguous("out", out)
    tensors = {"query": query, "key_cache": key_cache, "value_cache": value_cache}
    tensors |= {"block_tables": block_tables, "query_start": query_start}
    tensors |= {"context_lens": context_lens, "out": out}
    check_launch(_context_attention_kernel, "context_attention", tensors)
    num_seqs = context_lens.shape[0]
    if tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start[1:] - query_start[:-1]).max())
    if max_query_len == 0:
        return out
    kv_heads = key_cache.shape[2]
    if block_m is None:
        block_m = min(64, max(16, next_power_of_2(max_query_len)))
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size != next_power_of_2(size):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    launch(
        _context_attention_kernel, (cdiv(max_query_len, block_m), heads, num_seqs),
        query, key_cache, value_cache, block_tables, query_start, context_lens, out,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=key_cache.shape[1], GROUP=heads // kv_heads, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=upcast_dot(_context_attention_kernel, query.dtype),
        PRECISION=dot_precision(query.dtype),
    )  # fmt: skip
    return out


def prefill_attention(
    query: torch.Tensor,  # [tokens, heads, head_dim]
    key: torch.Tensor,  # [tokens, kv_heads, head_dim], the new tokens' keys
    value: torch.Tensor,  # [tokens, kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [tokens] int64: cache slot of each new token
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    query_start: torch.Tensor,  # [num_seqs + 1]
    context_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write the new keys/values into their slots, then ``context_attention``.

    ``slot_mapping`` must agree with the block tables (token ``j`` of sequence ``i`` at slot
    of position ``context_lens[i] - query_len + j``); the cached prefix is already in place.
    """
    store_kv(key, value, key_cache, value_cache, slot_mapping)
    return context_attention(
        query, key_cache, value_cache, block_tables, query_start, context_lens, scale,
        max_query_len=max_query_len, out=out,
    )  # fmt: skip


def context_attention_ref(
    query: torch.Tensor,  # [tokens, heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    query_start: torch.Tensor,  # [num_seqs + 1]
    context_lens: torch.Tensor,  # [num_seqs]
    scale: float,
) -> torch.Tensor:
    """Torch reference of ``context_attention`` (float32 math; unowned rows are zero)."""
    heads = query.shape[1]
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    for seq in range(context_lens.shape[0]):
        start, end = int(query_start[seq]), int(query_start[seq + 1])
        context_len, query_len = int(context_lens[seq]), end - start
        if query_len == 0:
            continue
        blocks = block_tables[seq, : math.ceil(context_len / block_size)].long()
        keys = key_cache[blocks].flatten(0, 1)[:context_len].float()  # [context, kv_heads, dim]
        values = value_cache[blocks].flatten(0, 1)[:context_len].float()
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # [context, heads, dim]
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), keys) * scale
        positions = torch.arange(context_len - query_len, context_len, device=query.device)
        hidden = torch.arange(context_len, device=query.device)[None, :] > positions[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))  # [heads, query_len, context]
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out.to(query.dtype)
