"""Where one transfer's messages land: blocks of a paged KV cache ``[layers, 2, blocks,
*block_shape]`` (``block_shape`` = block_size, kv_heads, head_dim in an engine's cache), and how
a received message gets there.

A message is ``[g, 2, num_blocks, *block_shape]``: ``g`` consecutive layers (the plan's
``layers_per_message``, chosen here from ``min_message_bytes``), each with the blocks in the
plan's ``block_order``, ascending destination block id (``plan.py``). Its destination is the K
and the V of those blocks of those layers. That is one contiguous region, in the message's
order, only when the blocks are all of the cache's blocks (a buffer made for the transfer, as
the prefill worker's staging of pulled KV): ``whole(message)`` is then that region, and the
message is received straight into it. Otherwise (a decode worker's cache: other blocks lie
between the reserved ones, and always between a layer's K and V) the message is received
into staging and ``scatter`` copies it into the blocks: one copy of the group's K and V per run
of consecutive blocks, or, on CUDA with several runs, one ``index_copy_`` of the whole group
(one kernel whatever the number of runs); queued on the current stream on CUDA.

The engine neither reads nor writes reserved blocks until the request's remote prefill
completes (``worker/kv_io.py``), so a transfer writes them off the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.transfer.plan import TransferPlan, group_layers

MIN_MESSAGE_BYTES = {"cuda": 16 << 20, "cpu": 1 << 20}
"""The smallest message a worker's receiver asks for, by its cache's device (``plan.py``,
Groups). On CUDA, where a message's fixed cost was worth some 10 MB of cuda_ipc's bandwidth
(H200, 2026-11-26), 16 MiB: a 1,024-token Llama-8B prompt (4 MiB a layer) in 8 messages of 4
layers instead of 32. On the CPU, 1 MiB: the default model's 1,024-token prompt in 15 messages
of 2 layers, its 128-token one in 2 of 15. Measured over UCX's shared memory with every layer
offered at once (``bench/bench_kv_transfer.py``, 2-core AMD EPYC Zen 5 VM, medians of 3 runs
of 11 repetitions, one layer a message in the same runs,
``bench/results/kv-transfer-2026-11-29-groups.json``): 128 tokens 1.10 -> 1.85 GB/s, 1,024
tokens 4.80 -> 5.00, in 4 runs 4.22 -> 4.79 (the two prompts alone: 1.21 -> 2.03 and 4.85 ->
5.52); 4 MiB groups gave 2.35 and 6.00 at four times the granularity. What a push exposes
after the prefill grows from one layer's transfer to one group's: at most about 1.5 MB on the
CPU (~0.3 ms), 16 MiB on a GPU (~50 us)."""


def min_message_bytes(device: torch.device, chosen: int | None = None) -> int:
    """``chosen`` (an operator's ``--kv-message-bytes``) when given, else ``MIN_MESSAGE_BYTES``
    of ``device``'s kind (0, one layer a message, for any other)."""
    if chosen is not None:
        return chosen
    return MIN_MESSAGE_BYTES.get(device.type, 0)


class KvDestination:
    """The blocks ``block_ids`` (block-table order, distinct) of ``cache``, as one transfer's
    destination; ``plan`` is the transfer's plan for them (``TransferPlan.for_destination``),
    with groups of layers of at least ``min_message_bytes`` (0: one layer a message).

    Invariant: ``scatter`` and a receive into ``whole`` write only those blocks.
    """

    def __init__(
        self,
        cache: torch.Tensor,
        block_ids: Sequence[int],
        min_message_bytes: int = 0,
        indexed: bool | None = None,
    ) -> None:
        """``indexed``: ``scatter`` is one ``index_copy_`` of the message, not a copy per
        run (None: on CUDA with several runs, where it is one kernel instead of many)."""
        # cache: [layers, 2, cache_blocks, *block_shape], contiguous
        if not cache.is_contiguous():
            raise ValueError("the KV cache must be contiguous to receive into it")
        if cache.dim() < 3 or cache.shape[1] != 2:
            raise ValueError(f"expected a [layers, 2, blocks, ...] cache, got {tuple(cache.shape)}")
        self.layer_bytes = 2 * len(block_ids) * cache[0, 0, 0].numel() * cache.element_size()
        """Bytes of one layer's part of a message: K and V of every block."""
        group = group_layers(cache.shape[0], self.layer_bytes, min_message_bytes)
        self.plan = TransferPlan.for_destination(block_ids, group)
        ordered = [block_ids[position] for position in self.plan.block_order]
        if ordered and not 0 <= ordered[0] <= ordered[-1] < cache.shape[2]:
            raise ValueError(f"block ids out of range for a cache of {cache.shape[2]} blocks")
        self._cache = cache
        self._runs = [  # (first destination block, first position in the message, blocks)
            (ordered[offset], offset, length)
            for offset, length in zip(self.plan.run_offsets(), self.plan.run_lengths, strict=True)
        ]
        self._index: torch.Tensor | None = None  # [num_blocks] destination ids, message order
        if indexed is None:
            indexed = cache.device.type == "cuda" and len(self._runs) > 1
        if indexed:
            # through pinned memory, queued: a decode worker makes a destination on its event
            # loop for every reservation, and a pageable copy would wait for the engine's step
            # (the receiver's transfer stream follows this stream: ``LayerReceiver``)
            index = torch.tensor(ordered, dtype=torch.long)  # [num_blocks]
            if cache.device.type == "cuda":
                index = index.pin_memory()
            self._index = index.to(cache.device, non_blocking=True)
        self._straight = len(ordered) == cache.shape[2]  # every block, ascending: one region

    @property
    def num_layers(self) -> int:
        return self._cache.shape[0]

    @property
    def num_messages(self) -> int:
        return self.num_layers // self.plan.layers_per_message

    @property
    def device(self) -> torch.device:
        return self._cache.device

    @property
    def message_bytes(self) -> int:
        """Bytes of one message: K and V of every block of the plan, for each of its layers."""
        return self.plan.layers_per_message * self.layer_bytes

    def _layers(self, message: int) -> slice:
        layers = self.plan.layers_of(message)
        return slice(layers.start, layers.stop)

    def whole(self, message: int) -> torch.Tensor | None:
        """``message``'s destination as one contiguous uint8 tensor in the message's order,
        or None when it is not one region (the message must go through staging)."""
        if not self._straight:
            return None
        return self._cache[self._layers(message)].view(-1).view(torch.uint8)

    def scatter(self, message: int, received: torch.Tensor) -> None:
        """Copy ``received`` (uint8, ``message_bytes``, contiguous: message ``message``'s
        layers, each its K and V in plan order) into those layers' blocks; on CUDA queued on
        the current stream."""
        cache = self._cache
        layers = self._layers(message)
        group = self.plan.layers_per_message
        # [group, 2, num_blocks, *block_shape]
        kv = received.view(cache.dtype).view(group, 2, self.plan.num_blocks, *cache.shape[3:])
        if self._index is not None:
            cache[layers].index_copy_(2, self._index, kv)
            return
        for first, offset, length in self._runs:
            cache[layers, :, first : first + length].copy_(kv[:, :, offset : offset + length])
