"""A paged KV cache tensor and block-wise copies in and out of it, shared by every runner.

The tensor is ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` (keys, then values),
contiguous, on the runner's device. Which blocks a request uses is the scheduler's business
(its block tables); this class only copies the blocks it is told to. Not thread-safe: see
``engine_face.PagedKv`` for who may touch which block when.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.host_copies import to_device
from splitserve.engine.host_memory import zeros_huge_pages


class KvBlockStore:
    """Owns the paged KV cache tensor of one engine."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.kv_cache = zeros_huge_pages(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
            dtype=dtype,
            device=device,
        )  # [layers, 2, blocks, block_size, kv_heads, head_dim]

    def read_kv_blocks(
        self, layer: int, block_ids: Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Copy of one layer's K and V in these blocks: ``[2, blocks, block, kv_heads, dim]``
        (into ``out`` when given: that shape, the cache's dtype and device, contiguous). On CUDA
        queued, with nothing waited for (the prefill worker's layer hook calls it between
        layers: a wait would stall the forward's launches)."""
        index = to_device(block_ids, torch.int64, self.device)  # [blocks]
        if out is None:
            return self.kv_cache[layer].index_select(1, index)
        return torch.index_select(self.kv_cache[layer], 1, index, out=out)

    def write_kv_blocks(self, layer: int, block_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Store ``kv`` (as ``read_kv_blocks`` returns it) into these blocks of one layer."""
        index = to_device(block_ids, torch.int64, self.device)  # [blocks]
        self.kv_cache[layer].index_copy_(1, index, kv.to(self.kv_cache.dtype))
