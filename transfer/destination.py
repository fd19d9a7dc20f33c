"""Where one transfer's layers land: blocks of a paged KV cache ``[layers, 2, blocks,
*block_shape]`` (``block_shape`` = block_size, kv_heads, head_dim in an engine's cache), and how
a received layer gets there.

A layer's message is ``[2, num_blocks, *block_shape]`` with the blocks in the plan's
``block_order``, ascending destination block id (``plan.py``). Its destination is the K and
the V of those blocks of that layer. That is one contiguous region, in the message's order,
only when the blocks are all of the cache's blocks (a buffer made for the transfer, as the
prefill worker's staging of pulled KV): ``whole(layer)`` is then that region, and the
message is received straight into it. Otherwise (a decode worker's cache: other blocks lie
between the reserved ones, and always between a layer's K and V) the message is received
into staging and ``scatter`` copies it into the blocks: one copy of K and V per run of
consecutive blocks, or, on CUDA with several runs, one ``index_copy_`` of the whole layer
(one kernel whatever the number of runs); queued on the current stream on CUDA.

The engine neither reads nor writes reserved blocks until the request's remote prefill
completes (``worker/kv_io.py``), so a transfer writes them off the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.transfer.plan import TransferPlan


class KvDestination:
    """The blocks ``block_ids`` (block-table order, distinct) of ``cache``, as one transfer's
    destination; ``plan`` is the transfer's plan for them (``TransferPlan.for_destination``).

    Invariant: ``scatter`` and a receive into ``whole`` write only those blocks.
    """

    def __init__(self, cache: torch.Tensor, block_ids: Sequence[int]) -> None:
        # cache: [layers, 2, cache_blocks, *block_shape], contiguous
        if not cache.is_contiguous():
            raise ValueError("the KV cache must be contiguous to receive into it")
        if cache.dim() < 3 or cache.shape[1] != 2:
            raise ValueError(f"expected a [layers, 2, blocks, ...] cache, got {tuple(cache.shape)}")
        self.plan = TransferPlan.for_destination(block_ids)
        ordered = [block_ids[position] for position in self.plan.block_order]
        if ordered and not 0 <= ordered[0] <= ordered[-1] < cache.shape[2]:
            raise ValueError(f"block ids out of range for a cache of {cache.shape[2]} blocks")
        self._cache = cache
        self._runs = [  # (first destination block, first position in the message, blocks)
            (ordered[offset], offset, length)
            for offset, length in zip(self.plan.run_offsets(), self.plan.run_lengths, strict=True)
        ]
        self._index: torch.Tensor | None = None  # [num_blocks] destination ids, message order
        if cache.device.type == "cuda" and len(self._runs) > 1:
            self._index = torch.tensor(ordered, dtype=torch.long, device=cache.device)
        self._straight = len(ordered) == cache.shape[2]  # every block, ascending: one region

    @property
    def num_layers(self) -> int:
        return self._cache.shape[0]

    @property
    def device(self) -> torch.device:
        return self._cache.device

    @property
    def message_bytes(self) -> int:
        """Bytes of one layer's message: K and V of every block of the plan."""
        cache = self._cache
        return 2 * self.plan.num_blocks * cache[0, 0, 0].numel() * cache.element_size()

    def whole(self, layer: int) -> torch.Tensor | None:
        """``layer``'s destination as one contiguous uint8 tensor in the message's order, or
        None when it is not one region (the message must go through staging)."""
        if not self._straight:
            return None
        return self._cache[layer].view(-1).view(torch.uint8)

    def scatter(self, layer: int, message: torch.Tensor) -> None:
        """Copy ``message`` (uint8, ``message_bytes``, contiguous: ``layer``'s K and V in plan
        order) into ``layer``'s blocks; on CUDA queued on the current stream."""
        cache = self._cache
        # [2, num_blocks, *block_shape]
        kv = message.view(cache.dtype).view(2, self.plan.num_blocks, *cache.shape[3:])
        if self._index is not None:
            cache[layer].index_copy_(1, self._index, kv)
            return
        for first, offset, length in self._runs:
            cache[layer, :, first : first + length].copy_(kv[:, offset : offset + length])
