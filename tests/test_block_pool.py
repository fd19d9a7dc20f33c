"""Block pool and KV cache manager: ref counts, free list order, prefix hashing, eviction."""

from __future__ import annotations

import pytest

from splitserve.common.blocks import hash_block, prefix_root, prompt_block_hashes
from splitserve.engine.block_pool import BlockPool, NoFreeBlocksError
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.transfer.plan import TransferPlan


def test_allocate_and_free_return_every_block() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert len(set(blocks)) == 5 and pool.num_free_blocks == 3
    pool.free(blocks)
    assert pool.num_free_blocks == 8
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(9)


def test_double_free_is_an_error() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError):
        pool.free([block])


def test_shared_block_is_free_only_after_last_reference() -> None:
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.touch([block])
    pool.free([block])
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 3
    pool.free([block])
    assert pool.num_free_blocks == 4


def test_free_cached_block_is_revived_by_touch_and_evicted_lru_first() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.register(a, b"hash-a")
    pool.register(b, b"hash-b")
    pool.free([a, b, c])  # a is least recently freed
    assert pool.lookup(b"hash-a") == a
    pool.touch([b])  # revive b from the free queue
    assert pool.num_free_blocks == 2
    [first] = pool.allocate(1)
    assert first == a and pool.lookup(b"hash-a") is None  # evicted
    assert pool.lookup(b"hash-b") == b  # still referenced, still cached


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.register(a, b"same")
    pool.register(b, b"same")
    assert pool.lookup(b"same") == a


def test_hash_chain_depends_on_prefix() -> None:
    first = hash_block(None, [1, 2])
    assert hash_block(first, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(None, [1, 2]) == first


def test_manager_reuses_cached_prefix_but_leaves_one_token() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(12))  # exactly 3 full blocks
    assert manager.allocate("a", len(prompt))
    manager.cache_full_blocks("a", prompt, num_computed=12)
    cached = manager.find_cached_prefix(prompt)
    assert cached == manager.block_table("a")[:2]  # 3rd block left so one token is computed
    longer = prompt + [99, 98]
    assert manager.find_cached_prefix(longer) == manager.block_table("a")
    manager.free("a")
    assert manager.num_free_blocks == 16
    # Freed but still cached: a new request revives the blocks.
    cached = manager.find_cached_prefix(longer)
    assert len(cached) == 3
    assert manager.allocate("b", len(longer), cached)
    assert manager.block_table("b")[:3] == cached
    assert manager.num_free_blocks == 16 - 4
    manager.free("b")
    assert manager.num_free_blocks == 16


def test_manager_allocate_fails_without_side_effects() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    assert manager.allocate("a", 12)
    assert not manager.allocate("b", 8)
    assert manager.block_table("b") == [] and manager.num_free_blocks == 1
    assert manager.find_cached_prefix(list(range(12))) == []  # caching off


def test_revived_free_blocks_count_against_capacity() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5]
    assert manager.allocate("a", 5)
    manager.cache_full_blocks("a", prompt, 5)
    manager.free("a")
    cached = manager.find_cached_prefix(prompt)
    assert len(cached) == 2
    # needs 3 new blocks + 2 revived = 5 > 4 free: must refuse and leave refs untouched
    assert not manager.allocate("b", 10, cached)
    assert manager.num_free_blocks == 4


def fragment(pool: BlockPool, keep_free: set[int]) -> None:
    """Leave exactly ``keep_free`` free (everything else referenced once)."""
    held = [block for block in pool.allocate(pool.num_free_blocks) if block not in keep_free]
    pool.free(sorted(keep_free))
    assert pool.num_free_blocks == len(keep_free) and len(held) == pool.num_blocks - len(keep_free)


def test_allocate_contiguous_takes_the_smallest_free_run_that_fits() -> None:
    pool = BlockPool(20)
    fragment(pool, {1, 2, 3, 4, 5, 8, 9, 10, 14, 15, 16, 17})  # runs of 5, 3 and 4
    assert pool.allocate_contiguous(4) == [14, 15, 16, 17]
    assert pool.allocate_contiguous(2) == [8, 9]  # the run of 3, not the run of 5
    assert pool.num_free_blocks == 6


def test_allocate_contiguous_falls_back_to_the_longest_runs() -> None:
    pool = BlockPool(20)
    fragment(pool, {0, 2, 3, 6, 7, 8, 9, 12, 13, 14})  # runs of 1, 2, 4, 3
    blocks = pool.allocate_contiguous(8)
    assert blocks == [6, 7, 8, 9, 12, 13, 14, 2]  # 4 + 3 + 1 of the 2-run: three runs
    assert pool.num_free_blocks == 2 and pool.allocate(2) in ([0, 3], [3, 0])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate_contiguous(1)


def test_allocate_contiguous_spares_cached_prefixes_while_uncached_runs_fit() -> None:
    """A freed conversation's blocks form a small free run: best fit over every free block
    would pick exactly them (and evict the conversation); blocks without a hash go first."""
    pool = BlockPool(20)
    fragment(pool, {3, 4, 5, 10, 11, 12, 13, 14, 15})  # runs of 3 and 6
    held = pool.allocate(3)  # the run 3..5 (least recently freed first), then cached
    assert held == [3, 4, 5]
    for block_id, name in zip(held, (b"t0", b"t1", b"t2"), strict=True):
        pool.register(block_id, name)
    pool.free(held[::-1])
    assert pool.allocate_contiguous(3) == [10, 11, 12]  # not the cached run 3..5
    assert [pool.lookup(name) for name in (b"t0", b"t1", b"t2")] == [3, 4, 5]
    assert pool.allocate_contiguous(3) == [13, 14, 15]
    assert pool.allocate_contiguous(2) == [3, 4]  # only cached blocks left: evicted then
    assert pool.lookup(b"t0") is None and pool.lookup(b"t2") == 5


def test_allocate_contiguous_keeps_the_pool_consistent() -> None:
    pool = BlockPool(16)
    [cached] = pool.allocate(1)
    pool.register(cached, b"prefix")
    pool.free([cached])
    taken = pool.allocate_contiguous(16)  # takes every block, the cached one too
    assert sorted(taken) == list(range(16)) and pool.num_free_blocks == 0
    assert pool.lookup(b"prefix") is None  # its hash was evicted
    pool.free(taken[::-1])
    assert pool.num_free_blocks == 16
    assert sorted(pool.allocate(16)) == list(range(16))  # every block came back exactly once


def test_remote_prefill_reservations_are_contiguous_in_a_fragmented_pool() -> None:
    def fragmented_manager() -> KVCacheManager:
        """Two requests that grew a block at a time, in turn, then finished: the free queue
        alternates between their blocks."""
        manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
        for blocks in range(1, 5):
            manager.allocate("a", 4 * blocks)
            manager.allocate("b", 4 * blocks)
        manager.free("a")
        manager.free("b")
        return manager

    def runs(table: list[int]) -> int:
        return TransferPlan.for_destination(table).num_runs

    lru = fragmented_manager()
    assert lru.allocate("local", 4 * 4)
    assert runs(lru.block_table("local")) == 4  # what a plain allocation gets here

    manager = fragmented_manager()
    assert manager.allocate("remote", 4 * 4, contiguous=True)
    assert runs(manager.block_table("remote")) == 1


def test_a_cache_salt_roots_a_chain_of_its_own() -> None:
    prompt = list(range(40))
    plain = prompt_block_hashes(prompt, 16)
    assert prefix_root("") is None and prompt_block_hashes(prompt, 16, prefix_root("")) == plain
    salted = prompt_block_hashes(prompt, 16, prefix_root("tenant-a"))
    assert salted == prompt_block_hashes(prompt, 16, prefix_root("tenant-a"))
    other = prompt_block_hashes(prompt, 16, prefix_root("tenant-b"))
    assert not set(salted) & set(plain) and not set(salted) & set(other)
