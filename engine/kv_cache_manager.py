"""Per-request block tables over a ``BlockPool``, with prefix caching.

Torch-free. A request's block table maps its token positions to block ids: token ``p`` lives
in block ``table[p // block_size]`` at offset ``p % block_size``.

Prefix caching: a block that is full of computed tokens is identified by a chained digest
``hash_i = H(hash_{i-1}, tokens of block i)``, so equal digests mean equal whole prefixes.
A new request reuses the longest run of cached full blocks of its prompt, but always leaves at
least one prompt token to compute (the model must produce logits for the last one), so cached
blocks are never written.

Invariant: after ``free(request_id)`` the request holds no reference on any block.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.common.blocks import BlockHash, blocks_for_tokens, hash_block
from splitserve.engine.block_pool import BlockPool


class KVCacheManager:
    """Allocates, caches and frees the blocks of each request."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks in position order (empty if it holds none)."""
        return self._tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` positions holds."""
        return blocks_for_tokens(num_tokens, self.block_size)

    def find_cached_prefix(
        self, token_ids: Sequence[int], root: BlockHash | None = None
    ) -> list[int]:
        """Blocks holding the longest cached prefix of ``token_ids`` (not yet referenced), its
        hashes chained from ``root`` (``Request.hash_root``: the request's salt and adapter).

        At most ``(len(token_ids) - 1) // block_size`` blocks, so one token is left to compute.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        blocks: list[int] = []
        parent = root
        for index in range(max_blocks):
            start = index * self.block_size
            parent = hash_block(parent, token_ids[start : start + self.block_size])
            block_id = self.pool.lookup(parent)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def allocate(
        self,
        request_id: str,
        num_total_tokens: int,
        cached_blocks: Sequence[int] = (),
        contiguous: bool = False,
    ) -> bool:
        """Grow the request's table to cover ``num_total_tokens`` positions.

        ``cached_blocks`` (from ``find_cached_prefix``, only for a request holding no blocks)
        become the head of its table. ``contiguous``: take the new blocks in as few runs of
        consecutive ids as possible (``BlockPool.allocate_contiguous``; for KV another worker
        pushes). Returns False, changing nothing, if the pool is short.
        """
        table = self._tables.get(request_id)
        if table is None:
            table = []
        elif cached_blocks:
            raise ValueError("cached prefix blocks can only start an empty table")
        have = len(table) + len(cached_blocks)
        needed = self.blocks_needed(num_total_tokens) - have
        # Cached blocks that sit in the free queue stop being allocatable once touched.
        revived = sum(1 for b in cached_blocks if self.pool.ref_count(b) == 0)
        if needed + revived > self.pool.num_free_blocks:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            table.extend(cached_blocks)
        if needed > 0:
            allocate = self.pool.allocate_contiguous if contiguous else self.pool.allocate
            table.extend(allocate(needed))
        self._tables[request_id] = table
        return True

    def cache_full_blocks(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed: int,
        root: BlockHash | None = None,
    ) -> None:
        """Register the request's blocks that are now full of computed tokens, their hashes
        chained from ``root`` (the request's, as ``find_cached_prefix``)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id, [])
        hashes = self._hashes.setdefault(request_id, [])
        num_full = min(num_computed // self.block_size, len(table))
        for index in range(len(hashes), num_full):
            start = index * self.block_size
            parent = hashes[-1] if hashes else root
            block_hash = hash_block(parent, token_ids[start : start + self.block_size])
            hashes.append(block_hash)
            self.pool.register(table[index], block_hash)

    def free(self, request_id: str) -> None:
        """Release every block of the request (tail first, so its prefix is evicted last)."""
        self.free_blocks(self.detach(request_id))

    def detach(self, request_id: str) -> list[int]:
        """Take the request's table away from it, its blocks still held: the id is free for
        another request, the blocks stay out of the pool until ``free_blocks`` (a step still
        running on the device may write them: ``Scheduler.settle``)."""
        self._hashes.pop(request_id, None)
        return self._tables.pop(request_id, [])

    def free_blocks(self, table: Sequence[int]) -> None:
        """Release the blocks of a table ``detach`` returned (tail first)."""
        self.pool.free(list(table)[::-1])
