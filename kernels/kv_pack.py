"""KV pack/unpack: a request's blocks of some layers <-> one contiguous transfer buffer.

The worker's cache is ``[layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim]``; the
transfer buffer of ``block_ids`` over ``layers`` is ``[len(layers), 2, len(block_ids),
block_size, kv_heads, head_dim]``, contiguous (one layer's slice is what
``splitserve.transfer`` sends per message). A program copies one chunk of one block of one
(layer, k/v) pair; a block's ``block_size * kv_heads * head_dim`` elements must be contiguous in
the cache, the layer and k/v strides are free.
"""

import math
from collections.abc import Sequence

import torch

from splitserve.kernels.triton_utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_contiguous_dims,
    check_launch,
    check_tensor,
    jit,
    launch,
    next_power_of_2,
    tl,
)

MAX_CHUNK = 4096
"""Elements one program copies at most (a block is split into chunks beyond that)."""


@jit
def _kv_copy_kernel(
    cache_ptr,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    buffer_ptr,  # [num_layers, 2, num_ids, block_size, kv_heads, head_dim], contiguous
    layer_ids_ptr,  # [num_layers]
    block_ids_ptr,  # [num_ids]
    num_ids,
    stride_cache_layer,
    stride_cache_kv,
    stride_cache_block,
    BLOCK_ELEMENTS: tl.constexpr,
    CHUNK: tl.constexpr,
    PACK: tl.constexpr,
):
    index = tl.program_id(0)  # position in block_ids
    layer_kv = tl.program_id(1)  # buffer layer * 2 + (0 for k, 1 for v)
    chunk = tl.program_id(2)
    layer = tl.load(layer_ids_ptr + layer_kv // 2).to(tl.int64)
    block = tl.load(block_ids_ptr + index).to(tl.int64)
    elements = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = elements < BLOCK_ELEMENTS
    cache_offsets = (
        layer * stride_cache_layer + (layer_kv % 2) * stride_cache_kv + block * stride_cache_block
    )
    buffer_offsets = (layer_kv.to(tl.int64) * num_ids + index) * BLOCK_ELEMENTS
    if PACK:
        data = tl.load(cache_ptr + cache_offsets + elements, mask=mask)
        tl.store(buffer_ptr + buffer_offsets + elements, data, mask=mask)
    else:
        data = tl.load(buffer_ptr + buffer_offsets + elements, mask=mask)
        tl.store(cache_ptr + cache_offsets + elements, data, mask=mask)


def _layer_ids(kv_cache: torch.Tensor, layers: Sequence[int] | None) -> torch.Tensor:
    """``layers`` (default: all) checked against the cache, as an int32 tensor on its device."""
    num_layers = kv_cache.shape[0]
    ids = list(range(num_layers)) if layers is None else [int(layer) for layer in layers]
    bad = [layer for layer in ids if not 0 <= layer < num_layers]
    if bad:
        raise ValueError(f"`layers` {bad} out of range for a cache of {num_layers} layers")
    return torch.tensor(ids, dtype=torch.int32, device=kv_cache.device)


def _check_cache(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    check_tensor("kv_cache", kv_cache, (None, 2, None, None, None, None), FLOAT_DTYPES)
    check_contiguous_dims("kv_cache", kv_cache, 3)
    check_tensor("block_ids", block_ids, (None,), INDEX_DTYPES)


def pack_kv(
    kv_cache: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    block_ids: torch.Tensor,  # [num_ids] int32/int64
    layers: Sequence[int] | None = None,
    *,
    out: torch.Tensor | None = None,  # [len(layers), 2, num_ids, block_size, kv_heads, head_dim]
) -> torch.Tensor:
    """Gather ``block_ids`` of ``layers`` (default: all) into one contiguous buffer.

    Block ids must be below ``num_blocks`` (not checked: a device sync).
    """
    _check_cache(kv_cache, block_ids)
    layer_ids = _layer_ids(kv_cache, layers)
    shape = (layer_ids.shape[0], 2, block_ids.shape[0], *kv_cache.shape[3:])
    if out is None:
        out = kv_cache.new_empty(shape)
    check_tensor("out", out, shape, (kv_cache.dtype,))
    if not out.is_contiguous():
        raise ValueError("`out` must be contiguous")
    tensors = {"kv_cache": kv_cache, "block_ids": block_ids, "out": out}
    check_launch(_kv_copy_kernel, "pack_kv", tensors)
    _run(kv_cache, out, layer_ids, block_ids, pack=True)
    return out


def unpack_kv(
    buffer: torch.Tensor,  # [len(layers), 2, num_ids, block_size, kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    block_ids: torch.Tensor,  # [num_ids] int32/int64, distinct
    layers: Sequence[int] | None = None,
) -> None:
    """Scatter a contiguous transfer buffer into ``block_ids`` of ``layers`` (in place)."""
    _check_cache(kv_cache, block_ids)
    layer_ids = _layer_ids(kv_cache, layers)
    shape = (layer_ids.shape[0], 2, block_ids.shape[0], *kv_cache.shape[3:])
    check_tensor("buffer", buffer, shape, (kv_cache.dtype,))
    if not buffer.is_contiguous():
        raise ValueError("`buffer` must be contiguous")
    tensors = {"buffer": buffer, "kv_cache": kv_cache, "block_ids": block_ids}
    check_launch(_kv_copy_kernel, "unpack_kv", tensors)
    _run(kv_cache, buffer, layer_ids, block_ids, pack=False)


def _run(
    kv_cache: torch.Tensor,
    buffer: torch.Tensor,
    layer_ids: torch.Tensor,
    block_ids: torch.Tensor,
    *,
    pack: bool,
) -> None:
    block_elements = math.prod(kv_cache.shape[3:])
    chunk = min(MAX_CHUNK, next_power_of_2(block_elements))
    grid = (block_ids.shape[0], 2 * layer_ids.shape[0], cdiv(block_elements, chunk))
    if 0 in grid:
        return
    launch(
        _kv_copy_kernel, grid,
        kv_cache, buffer, layer_ids, block_ids, block_ids.shape[0],
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        BLOCK_ELEMENTS=block_elements, CHUNK=chunk, PACK=pack,
    )  # fmt: skip


def pack_kv_ref(
    kv_cache: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    block_ids: torch.Tensor,  # [num_ids]
    layers: Sequence[int] | None = None,
) -> torch.Tensor:
    """Torch reference of ``pack_kv``."""
    selected = kv_cache if layers is None else kv_cache[list(layers)]
    return selected[:, :, block_ids.long()].contiguous()


def unpack_kv_ref(
    buffer: torch.Tensor,  # [len(layers), 2, num_ids, block_size, kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    block_ids: torch.Tensor,  # [num_ids]
    layers: Sequence[int] | None = None,
) -> None:
    """Torch reference of ``unpack_kv``."""
    layer_list = range(kv_cache.shape[0]) if layers is None else list(layers)
    for position, layer in enumerate(layer_list):
        kv_cache[layer].index_copy_(1, block_ids.long(), buffer[position])
