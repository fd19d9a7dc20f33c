"""Store new tokens' keys and values into their paged-cache slots.

Slot ``s`` is block ``s // block_size``, offset ``s % block_size`` of the cache
``[num_blocks, block_size, kv_heads, head_dim]`` (the engine's layout, one layer); a negative
slot skips its token (padding).
"""

import torch

from splitserve.kernels.triton_utils import (
    FLOAT_DTYPES,
    check_last_dim_contiguous,
    check_launch,
    check_same_dtype,
    check_tensor,
    jit,
    launch,
    next_power_of_2,
    tl,
)


@jit
def _store_kv_kernel(
    key_ptr,  # [tokens, kv_heads, head_dim]
    value_ptr,  # [tokens, kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache_ptr,  # same shape and strides as the key cache
    slot_mapping_ptr,  # [tokens] int64
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, KV_HEADS_PAD)
        dims = tl.arange(0, HEAD_DIM_PAD)
        mask = (heads[:, None] < KV_HEADS) & (dims[None, :] < HEAD_DIM)
        cache_offsets = (
            (slot // BLOCK_SIZE) * stride_cache_block
            + (slot % BLOCK_SIZE) * stride_cache_slot
            + heads[:, None] * stride_cache_head
            + dims[None, :]
        )  # [KV_HEADS_PAD, HEAD_DIM_PAD]
        key_offsets = token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :]
        value_offsets = (
            token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :]
        )
        key = tl.load(key_ptr + key_offsets, mask=mask)
        value = tl.load(value_ptr + value_offsets, mask=mask)
        tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
        tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


def store_kv(
    key: torch.Tensor,  # [tokens, kv_heads, head_dim]
    value: torch.Tensor,  # [tokens, kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [tokens] int64, -1 to skip a token
) -> None:
    """Write each token's key and value into its cache slot (in place).

    Key and value may be strided views (e.g. of a fused qkv projection) with a contiguous last
    dimension; slots must be distinct and below ``num_blocks * block_size`` (not checked: a
    device sync).
    """
    check_tensor("key", key, (None, None, None), FLOAT_DTYPES)
    tokens, kv_heads, head_dim = key.shape
    check_tensor("value", value, (tokens, kv_heads, head_dim), (key.dtype,))
    check_tensor("key_cache", key_cache, (None, None, kv_heads, head_dim), (key.dtype,))
    check_tensor("value_cache", value_cache, tuple(key_cache.shape), (key.dtype,))
    check_same_dtype("value_cache", value_cache, "key_cache", key_cache.dtype)
    if value_cache.stride() != key_cache.stride():
        raise ValueError(
            f"`value_cache` strides {value_cache.stride()} differ from `key_cache` strides "
            f"{key_cache.stride()}"
        )
    check_tensor("slot_mapping", slot_mapping, (tokens,), (torch.int64, torch.int32))
    for name, tensor in (("key", key), ("value", value), ("key_cache", key_cache)):
        check_last_dim_contiguous(name, tensor)
    tensors = {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache}
    check_launch(_store_kv_kernel, "store_kv", tensors | {"slot_mapping": slot_mapping})
    if tokens == 0:
        return
    launch(
        _store_kv_kernel, (tokens,),
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[1], KV_HEADS=kv_heads,
        KV_HEADS_PAD=next_power_of_2(kv_heads), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
    )  # fmt: skip


def store_kv_ref(
    key: torch.Tensor,  # [tokens, kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [tokens]
) -> None:
    """Torch reference of ``store_kv``."""
    kept = slot_mapping >= 0
    slots = slot_mapping[kept].long()
    kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, key[kept])
    value_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, value[kept])
