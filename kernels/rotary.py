"""Rotary position embedding (HF "rotate half" layout), applied in place to queries and keys.

For each token at ``positions[t]`` and each head: ``x1, x2 = x[:half], x[half:]`` become
``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin``, with ``cos, sin`` the rows of the tables
``[max_positions, head_dim]`` (halves repeated, as ``engine.rotary.cos_sin_table`` builds them;
only the first half is read). Computed in float32, rounded once. Queries and keys may be
strided views (e.g. of a fused qkv projection) with a contiguous last dimension.
"""

import torch

from splitserve.kernels.triton_utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_last_dim_contiguous,
    check_launch,
    check_tensor,
    jit,
    launch,
    next_power_of_2,
    tl,
)


@jit
def _rotate_heads(
    x_ptr,  # one token's [heads, head_dim]
    stride_head,
    cos,  # [1, HALF_PAD] float32
    sin,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)
    columns = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < HEADS) & (columns[None, :] < HALF)
    first = x_ptr + heads[:, None] * stride_head + columns[None, :]  # [HEADS_PAD, HALF_PAD]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@jit
def _rotary_kernel(
    query_ptr,  # [tokens, heads, head_dim]
    key_ptr,  # [tokens, kv_heads, head_dim]
    cos_ptr,  # [max_positions, head_dim]
    sin_ptr,  # [max_positions, head_dim]
    positions_ptr,  # [tokens]
    stride_query_token,
    stride_query_head,
    stride_key_token,
    stride_key_head,
    stride_table_row,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    columns = tl.arange(0, HALF_PAD)
    table_mask = columns < HALF
    table_offsets = position * stride_table_row + columns
    cos = tl.load(cos_ptr + table_offsets, mask=table_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + table_offsets, mask=table_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(
        query_ptr + token * stride_query_token, stride_query_head, cos, sin,
        HEADS, HEADS_PAD, HALF, HALF_PAD,
    )  # fmt: skip
    _rotate_heads(
        key_ptr + token * stride_key_token, stride_key_head, cos, sin,
        KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD,
    )  # fmt: skip


def rotary_embedding(
    query: torch.Tensor,  # [tokens, heads, head_dim], rotated in place
    key: torch.Tensor,  # [tokens, kv_heads, head_dim], rotated in place
    cos: torch.Tensor,  # [max_positions, head_dim]
    sin: torch.Tensor,  # [max_positions, head_dim]
    positions: torch.Tensor,  # [tokens] int32/int64, each < max_positions (not checked)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` and ``key`` in place by their tokens' positions; returns them."""
    check_tensor("query", query, (None, None, None), FLOAT_DTYPES)
    tokens, _, head_dim = query.shape
    if head_dim % 2:
        raise ValueError(f"`query` head_dim must be even, got {head_dim}")
    check_tensor("key", key, (tokens, None, head_dim), (query.dtype,))
    check_tensor("cos", cos, (None, head_dim), FLOAT_DTYPES)
    check_tensor("sin", sin, tuple(cos.shape), (cos.dtype,))
    if sin.stride() != cos.stride():
        raise ValueError(f"`sin` strides {sin.stride()} differ from `cos` strides {cos.stride()}")
    check_tensor("positions", positions, (tokens,), INDEX_DTYPES)
    for name, tensor in (("query", query), ("key", key), ("cos", cos)):
        check_last_dim_contiguous(name, tensor)
    tensors = {"query": query, "key": key, "cos": cos, "sin": sin, "positions": positions}
    check_launch(_rotary_kernel, "rotary_embedding", tensors)
    if tokens:
        heads, kv_heads, half = query.shape[1], key.shape[1], head_dim // 2
        launch(
            _rotary_kernel, (tokens,),
            query, key, cos, sin, positions,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos.stride(0),
            HEADS=heads, HEADS_PAD=next_power_of_2(heads),
            KV_HEADS=kv_heads, KV_HEADS_PAD=next_power_of_2(kv_heads),
            HALF=half, HALF_PAD=next_power_of_2(half),
        )  # fmt: skip
    return query, key


def rotary_embedding_ref(
    x: torch.Tensor,  # [tokens, heads, head_dim]
    cos: torch.Tensor,  # [max_positions, head_dim]
    sin: torch.Tensor,
    positions: torch.Tensor,  # [tokens]
) -> torch.Tensor:
    """Torch reference of ``rotary_embedding`` for one of query/key; returns a new tensor."""
    half = x.shape[-1] // 2
    cos_rows = cos[positions.long(), :half].float()[:, None, :]  # [tokens, 1, half]
    sin_rows = sin[positions.long(), :half].float()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    rotated = torch.cat((x1 * cos_rows - x2 * sin_rows, x2 * cos_rows + x1 * sin_rows), dim=-1)
    return rotated.to(x.dtype)
