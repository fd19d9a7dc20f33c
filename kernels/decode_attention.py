"""Paged decode attention: one query token per sequence over its paged KV context.

GQA-aware: a program owns one KV head of one sequence and computes all ``heads // kv_heads``
query heads that share it, so each key and value is read from the cache once per program.
Split-K ("flash-decoding"): a sequence's context is cut into at most ``num_splits`` ranges, one
program each, whose partial results (output and log-sum-exp) a second kernel merges; this keeps
the GPU busy at small batch and long context. Each sequence splits its *own* length
(``split_tokens``): ranges of ``ceil(len / num_splits)`` tokens, at least ``min_split_tokens``,
rounded up to whole key tiles; the programs past its last range find nothing to do. So a row's
ranges never depend on the other rows' lengths, and a launch sized for a long context (a CUDA
graph's, which is sized for the tables' whole width) still spreads a short context over
several programs.

Cache layout (the engine's, one layer): ``[num_blocks, block_size, kv_heads, head_dim]``; token
``t`` of a sequence is at block ``block_tables[seq, t // block_size]``, offset
``t % block_size``. ``block_size`` need not be a power of two. Inputs may be float16, bfloat16
or float32; scores, softmax and the weighted sum accumulate in float32. A sequence of length 0
(an empty batch slot) gets an all-zero output row.
"""

import math

import torch

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

MIN_TOKENS_PER_SPLIT = 256
"""The default split count keeps at least this many tokens per split."""


@jit
def _decode_kernel(
    query_ptr,  # [batch, heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache_ptr,  # same shape and strides as the key cache
    block_tables_ptr,  # [batch, max_blocks]
    seq_lens_ptr,  # [batch]
    out_ptr,  # [batch, heads, head_dim], or partials [batch, heads, splits, head_dim] f32
    lse_ptr,  # [batch, heads, splits] float32 (log2 domain), with SPLIT only
    qk_scale,  # softmax scale * log2(e)
    min_split_tokens,
    stride_query_seq,
    stride_query_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    stride_out_seq,
    stride_out_head,
    stride_out_split,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    tokens_per_split = tl.maximum(tl.cdiv(seq_len, num_splits), min_split_tokens)
    tokens_per_split = tl.cdiv(tokens_per_split, BLOCK_N) * BLOCK_N  # split_tokens, in-kernel
    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)

    rows = tl.arange(0, GROUP_PAD)  # query heads of this KV head (padded)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    query_offsets = seq * stride_query_seq + heads[:, None] * stride_query_head + dims[None, :]
    query = tl.load(query_ptr + query_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        query = query.to(tl.float32)  # [GROUP_PAD, HEAD_DIM_PAD]

    row_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    for start in range(split_start, split_end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        token_ok = positions < split_end
        block = tl.load(table_row + positions // BLOCK_SIZE, mask=token_ok, other=0)
        slots = (
            block.to(tl.int64) * stride_cache_block + (positions % BLOCK_SIZE) * stride_cache_slot
        )
        kv_offsets = slots[:, None] + kv_head * stride_cache_head + dims[None, :]
        kv_mask = token_ok[:, None] & dim_ok[None, :]
        key = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [BLOCK_N, DIM_PAD]
        value = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if UPCAST:
            key = key.to(tl.float32)
            value = value.to(tl.float32)
        scores = tl.dot(query, tl.trans(key), input_precision=PRECISION) * qk_scale
        scores = tl.where(token_ok[None, :], scores, float("-inf"))  # [GROUP_PAD, BLOCK_N]
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        correction = tl.exp2(row_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * correction + tl.sum(probs, 1)
        acc = acc * correction[:, None] + tl.dot(
            probs.to(value.dtype), value, input_precision=PRECISION
        )
        row_max = new_max

    has_tokens = row_sum > 0.0
    out = acc / tl.where(has_tokens, row_sum, 1.0)[:, None]  # zeros for an empty range
    out_offsets = seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :]
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        tl.store(out_ptr + out_offsets + split * stride_out_split, out, mask=out_mask)
        log_sum = tl.log2(tl.where(has_tokens, row_sum, 1.0))
        lse = tl.where(has_tokens, row_max + log_sum, float("-inf"))
        lse_offsets = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(lse_ptr + lse_offsets, lse, mask=row_ok)
    else:
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@jit
def _merge_kernel(
    partial_ptr,  # [batch, heads, splits, head_dim] float32
    lse_ptr,  # [batch, heads, splits] float32 (log2 domain)
    out_ptr,  # [batch, heads, head_dim]
    num_splits,
    stride_out_seq,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_ok = splits < num_splits
    lse = tl.load(lse_ptr + row * num_splits + splits, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # [SPLITS_PAD]
    partial_offsets = (row * num_splits + splits[:, None]) * HEAD_DIM + dims[None, :]
    partial_mask = split_ok[:, None] & (dims[None, :] < HEAD_DIM)
    partial = tl.load(partial_ptr + partial_offsets, mask=partial_mask, other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(weights[:, None] * partial, 0) / tl.where(total > 0.0, total, 1.0)
    out_offsets = seq * stride_out_seq + head * stride_out_head + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def split_tokens(seq_len: int, num_splits: int, min_split_tokens: int, block_n: int) -> int:
    """Tokens per split-K range of a sequence of ``seq_len`` tokens (the kernel's formula):
    ``ceil(seq_len / num_splits)``, at least ``min_split_tokens``, rounded up to a multiple of
    ``block_n``. ``num_splits`` such ranges always cover the sequence."""
    tokens = max(cdiv(seq_len, num_splits), min_split_tokens)
    return cdiv(tokens, block_n) * block_n


def default_block_n(max_seq_len: int, num_splits: int) -> int:
    """Keys per loop step for a launch whose longest context is ``max_seq_len``: the split
    length's next power of two, from 16 to 64."""
    return min(64, max(16, next_power_of_2(cdiv(max(max_seq_len, 1), num_splits))))


def default_num_splits(batch: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """``splits_for_sms`` with the device's SM count; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    return splits_for_sms(batch, kv_heads, max_seq_len, sm_count)


def splits_for_sms(batch: int, kv_heads: int, max_seq_len: int, sm_count: int) -> int:
    """Enough splits to give each of ``sm_count`` SMs about two programs, each over >= 256
    tokens of the longest context (``MIN_TOKENS_PER_SPLIT``)."""
    programs = max(batch * kv_heads, 1)
    wanted = cdiv(2 * sm_count, programs)
    return max(1, min(wanted, cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT)))


def _check_tile(name: str, size: int) -> None:
    if size < 16 or size != next_power_of_2(size):
        raise ValueError(f"{name} must be a power of two >= 16, got {size}")


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    check_tensor("query", query, (None, None, None), FLOAT_DTYPES)
    batch, heads, head_dim = query.shape
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
    check_last_dim_contiguous("query", query)
    check_last_dim_contiguous("key_cache", key_cache)
    check_tensor("block_tables", block_tables, (batch, None), INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, (batch,), INDEX_DTYPES)
    check_last_dim_contiguous("block_tables", block_tables)


def paged_decode_attention(
    query: torch.Tensor,  # [batch, heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [batch] int32/int64, 0 for an empty slot
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    min_split_tokens: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,  # [batch, heads, head_dim], query's dtype
) -> torch.Tensor:
    """Attention of each sequence's single query over its first ``seq_lens[i]`` cached tokens.

    Returns ``[batch, heads, head_dim]`` in the query's dtype (``out`` if given). The caller
    guarantees ``seq_lens[i] <= max_blocks * block_size`` and valid block ids; ``max_seq_len``
    (an upper bound of ``seq_lens``) avoids a device sync and sizes the launch. ``num_splits``
    overrides ``default_num_splits`` (the most ranges a sequence is cut into), and
    ``min_split_tokens`` the least tokens of a range (default: ``MIN_TOKENS_PER_SPLIT`` with
    the default split count, else 1); ``block_n`` (keys per loop step, a power of two >= 16)
    the tile chosen from the longest context's split length. A sequence's result depends on
    its own length, ``num_splits``, ``min_split_tokens`` and ``block_n`` only (module
    docstring), never on the other rows'.
    """
    _check_inputs(query, key_cache, value_cache, block_tables, seq_lens)
    batch, heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    check_tensor("out", out, tuple(query.shape), (query.dtype,))
    check_last_dim_contiguous("out", out)
    tensors = {"query": query, "key_cache": key_cache, "value_cache": value_cache}
    tensors |= {"block_tables": block_tables, "seq_lens": seq_lens, "out": out}
    check_launch(_decode_kernel, "paged_decode_attention", tensors)
    if batch == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    capacity = block_tables.shape[1] * block_size
    if max_seq_len > capacity:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds the block tables' {capacity} slots")
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, max_seq_len, query.device)
        if min_split_tokens is None:
            min_split_tokens = MIN_TOKENS_PER_SPLIT
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    min_split_tokens = 1 if min_split_tokens is None else min_split_tokens
    if min_split_tokens < 1:
        raise ValueError(f"min_split_tokens must be >= 1, got {min_split_tokens}")
    longest = max(max_seq_len, 1)
    if block_n is None:
        block_n = default_block_n(longest, num_splits)
    _check_tile("block_n", block_n)
    # None empty for the longest: fewer splits cover every row too (split_tokens' contract).
    num_splits = cdiv(longest, split_tokens(longest, num_splits, min_split_tokens, block_n))
    split = num_splits > 1
    if split:
        partial = query.new_empty(batch, heads, num_splits, head_dim, dtype=torch.float32)
        lse = query.new_empty(batch, heads, num_splits, dtype=torch.float32)
        target, target_strides = partial, partial.stride()[:3]
    else:
        partial = lse = out  # lse unused without SPLIT
        target, target_strides = out, (*out.stride()[:2], 0)
    group = heads // kv_heads
    launch(
        _decode_kernel, (batch, kv_heads, num_splits),
        query, key_cache, value_cache, block_tables, seq_lens, target, lse,
        scale * LOG2E, min_split_tokens,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        *target_strides,
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)), BLOCK_N=block_n,
        SPLIT=split, UPCAST=upcast_dot(_decode_kernel, query.dtype),
        PRECISION=dot_precision(query.dtype),
    )  # fmt: skip
    if split:
        launch(
            _merge_kernel, (batch, heads),
            partial, lse, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=next_power_of_2(head_dim),
            SPLITS_PAD=next_power_of_2(num_splits),
        )  # fmt: skip
    return out


def paged_decode_attention_ref(
    query: torch.Tensor,  # [batch, heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks]
    seq_lens: torch.Tensor,  # [batch]
    scale: float,
) -> torch.Tensor:
    """Torch reference of ``paged_decode_attention``: float32 math, one sequence at a time."""
    batch, heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(batch, heads, head_dim, dtype=torch.float32, device=query.device)
    for seq in range(batch):
        length = int(seq_lens[seq])
        if length == 0:
            continue
        blocks = block_tables[seq, : math.ceil(length / block_size)].long()
        keys = key_cache[blocks].flatten(0, 1)[:length].float()  # [length, kv_heads, dim]
        values = value_cache[blocks].flatten(0, 1)[:length].float()
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # [length, heads, dim]
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,khd->hk", query[seq].float(), keys) * scale  # [heads, length]
        out[seq] = torch.einsum("hk,khd->hd", scores.softmax(-1), values)
    return out.to(query.dtype)
