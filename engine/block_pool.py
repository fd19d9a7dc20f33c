"""Pool of fixed-size KV-cache blocks: reference counts, an LRU free list, a prefix-hash index.

Torch-free: this module only hands out block ids; the tensors live with the model runner.

Invariants:
- Every block id in ``[0, num_blocks)`` is either referenced (``ref_count > 0``) or in the free
  queue, never both. ``num_free_blocks == len(free queue)``.
- A free block may still hold a cached prefix (it has a hash). It stays reusable by a prefix hit
  until ``allocate`` hands it out again, which evicts the hash (least recently freed first);
  ``allocate_contiguous`` evicts the hashes of whatever blocks it picks, so it looks among
  free blocks that hold no cached prefix first, and takes cached ones only when those have
  no run that fits.
- ``allocate``, ``free`` of one block, ``touch`` of one block and ``lookup`` are O(1);
  ``allocate_contiguous`` scans a free-block bitmap, O(num_blocks) at C speed.
- ``_free_mask[b] == 1`` exactly when block ``b`` is in the free queue; ``_clean_mask[b] ==
  1`` exactly when it is in the free queue and holds no cached prefix (no hash).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from splitserve.common.blocks import BlockHash

_FREE_RUN = re.compile(b"\x01+")
"""A run of free blocks in the free mask."""


class NoFreeBlocksError(RuntimeError):
    """``allocate`` was asked for more blocks than are free (callers check first)."""


class BlockPool:
    """Hands out block ids with reference counting and a prefix-cache index."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts: list[int] = [0] * num_blocks
        self._hash_of_block: list[BlockHash | None] = [None] * num_blocks
        self._block_of_hash: dict[BlockHash, int] = {}
        self.cache_listener: Callable[[BlockHash, bool], None] | None = None
        """Told of every change to the prefix index as it happens: (hash, True) when a block
        hash enters it, (hash, False) when it is evicted (the worker's KV events)."""
        # Insertion order is eviction order: the front is the least recently freed block.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_mask = bytearray(b"\x01") * num_blocks
        self._clean_mask = bytearray(b"\x01") * num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now (including evictable cached ones)."""
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        """References held on ``block_id`` (0 = free)."""
        return self._ref_counts[block_id]

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks (ref count 1 each), evicting their cached hashes."""
        if count > len(self._free_queue):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free_queue)} free")
        blocks: list[int] = []
        for _ in range(count):
            block_id, _ = self._free_queue.popitem(last=False)
            self._take(block_id)
            blocks.append(block_id)
        return blocks

    def allocate_contiguous(self, count: int) -> list[int]:
        """Like ``allocate``, but in as few runs of consecutive block ids as the free blocks
        allow, ascending within each run: the smallest free run that holds ``count`` blocks,
        else the longest free runs.

        For blocks another worker writes into (a KV transfer moves one message per run).
        Free blocks without a cached prefix come first: the smallest run of them that holds
        ``count``; only when none does, runs of any free blocks as above (ignoring the LRU
        order, so it may then evict a cached prefix ``allocate`` would have kept).
        """
        if count > len(self._free_queue):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free_queue)} free")
        clean = [match.span() for match in _FREE_RUN.finditer(self._clean_mask)]
        fitting = [(end - start, start) for start, end in clean if end - start >= count]
        runs = []
        if not fitting:
            runs = [match.span() for match in _FREE_RUN.finditer(self._free_mask)]
            fitting = [(end - start, start) for start, end in runs if end - start >= count]
        if fitting:
            _, start = min(fitting)
            chosen = [(start, start + count)]
        else:
            chosen, missing = [], count
            for start, end in sorted(runs, key=lambda run: run[0] - run[1]):  # longest first
                take = min(end - start, missing)
                chosen.append((start, start + take))
                missing -= take
                if missing == 0:
                    break
        blocks = [block for start, end in chosen for block in range(start, end)]
        for block_id in blocks:
            del self._free_queue[block_id]
            self._take(block_id)
        return blocks

    def _take(self, block_id: int) -> None:
        """A block just left the free queue for its first reference."""
        self._evict_hash(block_id)
        self._ref_counts[block_id] = 1
        self._free_mask[block_id] = 0
        self._clean_mask[block_id] = 0

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (a prefix-cache hit, or a KV transfer's hold on its
        reserved blocks), reviving free cached blocks."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free_queue[block_id]
                self._free_mask[block_id] = 0
                self._clean_mask[block_id] = 0
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block.

        Blocks reaching zero join the free queue in the given order, so pass a request's
        blocks tail first: its last blocks are then evicted before its shared prefix.
        """
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than referenced")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free_queue[block_id] = None
                self._free_mask[block_id] = 1
                self._clean_mask[block_id] = self._hash_of_block[block_id] is None

    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash in the prefix index now."""
        return list(self._block_of_hash)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding the prefix with this hash, if it is still cached."""
        return self._block_of_hash.get(block_hash)

    def register(self, block_id: int, block_hash: BlockHash) -> None:
        """Record that ``block_id`` now holds the full block identified by ``block_hash``.

        If another block already holds the same content, the first one stays the canonical
        entry and this block simply remains uncached.
        """
        if self._hash_of_block[block_id] is not None or block_hash in self._block_of_hash:
            return
        self._hash_of_block[block_id] = block_hash
        self._block_of_hash[block_hash] = block_id
        self._clean_mask[block_id] = 0
        if self.cache_listener is not None:
            self.cache_listener(block_hash, True)

    def _evict_hash(self, block_id: int) -> None:
        block_hash = self._hash_of_block[block_id]
        if block_hash is not None:
            self._hash_of_block[block_id] = None
            del self._block_of_hash[block_hash]
            if self.cache_listener is not None:
                self.cache_listener(block_hash, False)
