"""KV block metadata, the free queue and the block pool with its prefix-hash map."""

from __future__ import annotations

import pytest

from scheduler_svc.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from scheduler_svc.prefix_hash import BlockHash, hash_block_tokens


def _hash(i: int) -> BlockHash:
    return hash_block_tokens(None, [i], None)


def _ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_block_hash_is_write_once_until_reset() -> None:
    block = KVCacheBlock(block_id=3)
    block.block_hash = _hash(1)
    with pytest.raises(AssertionError, match="already has a hash"):
        block.block_hash = _hash(2)
    block.reset_hash()
    assert block.block_hash is None
    block.block_hash = _hash(2)
    assert block.block_hash == _hash(2)


def test_repr_names_neighbours_by_id() -> None:
    blocks = [KVCacheBlock(block_id=i) for i in range(3)]
    FreeBlockQueue(blocks)
    text = repr(blocks[1])
    assert "prev_free=0" in text and "next_free=2" in text


def test_free_queue_order_and_removal_from_the_middle() -> None:
    blocks = [KVCacheBlock(block_id=i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.check_invariants()
    assert _ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4]

    queue.remove(blocks[2])
    queue.check_invariants()
    assert _ids(queue.get_all_free_blocks()) == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.check_invariants()
    queue.append(blocks[0])
    queue.appendleft(blocks[2])
    queue.check_invariants()
    assert _ids(queue.get_all_free_blocks()) == [2, 1, 3, 4, 0]
    assert queue.num_free_blocks == 5

    with pytest.raises(AssertionError, match="already queued"):
        queue.append(blocks[3])
    for _ in range(5):
        queue.popleft()
    queue.check_invariants()
    with pytest.raises(AssertionError, match="empty free queue"):
        queue.popleft()
    with pytest.raises(AssertionError, match="not in the free queue"):
        queue.remove(blocks[0])


def test_new_blocks_are_referenced_and_over_asking_is_a_bug() -> None:
    pool = BlockPool(4, enable_caching=True)
    pool.check_invariants()
    blocks = pool.get_new_blocks(3)
    pool.check_invariants()
    assert _ids(blocks) == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    with pytest.raises(ValueError, match="asked for 2 blocks, 1 free"):
        pool.get_new_blocks(2)


def test_cached_blocks_are_found_revived_and_evicted_lru() -> None:
    pool = BlockPool(4, enable_caching=True)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [_hash(0), _hash(1)])
    pool.check_invariants()
    assert pool.get_cached_block(_hash(1)) is a[1]
    assert pool.num_cached_blocks == 2

    # Freed in reverse (chain tail first): the tail is evicted first, after the
    # unhashed blocks that were never used.
    pool.free_blocks(reversed(a))
    pool.check_invariants()
    assert _ids(pool.free_queue.get_all_free_blocks()) == [2, 3, 1, 0]
    assert pool.get_cached_block(_hash(0)) is a[0], "free cached blocks stay findable"

    pool.touch([a[0]])  # a prefix hit revives a free cached block
    pool.check_invariants()
    assert a[0].ref_cnt == 1 and pool.num_free_blocks == 3

    taken = pool.get_new_blocks(3)
    pool.check_invariants()
    assert _ids(taken) == [2, 3, 1]
    assert pool.get_cached_block(_hash(1)) is None, "eviction drops the hash entry"
    assert a[1].block_hash is None
    assert pool.get_cached_block(_hash(0)) is a[0]


def test_unhashed_freed_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(3, enable_caching=True)
    cached, plain = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(cached, [_hash(7)])
    pool.free_blocks(cached)
    pool.free_blocks(plain)
    pool.check_invariants()
    assert _ids(pool.free_queue.get_all_free_blocks()) == [1, 2, 0]


def test_shared_block_stays_referenced_until_last_free() -> None:
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [_hash(0)])
    pool.touch([block])
    pool.check_invariants()
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    pool.check_invariants()
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    pool.check_invariants()
    with pytest.raises(AssertionError, match="freeing unreferenced"):
        pool.free_blocks([block])


def test_identical_blocks_are_not_deduplicated() -> None:
    pool = BlockPool(2, enable_caching=True)
    first, second = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(first, [_hash(5)])
    pool.cache_full_blocks(second, [_hash(5)])
    pool.check_invariants()
    assert pool.get_cached_block(_hash(5)) is first[0]
    assert second[0].block_hash is None
    pool.cache_full_blocks(first, [_hash(5)])  # re-offering the same block is harmless
    pool.check_invariants()
    with pytest.raises(AssertionError, match="re-cached under another hash"):
        pool.cache_full_blocks(first, [_hash(6)])


def test_caching_disabled_never_hashes() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [_hash(0), _hash(1)])
    pool.check_invariants()
    assert pool.num_cached_blocks == 0
    assert all(b.block_hash is None for b in blocks)


def test_check_invariants_catches_corruption() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(1)
    blocks[0].ref_cnt = 0  # referenced count lost, yet not in the free queue
    with pytest.raises(AssertionError, match="ref_cnt == 0"):
        pool.check_invariants()

    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(1)
    blocks[0].block_hash = _hash(0)  # a hash set behind the pool's back: not in the map
    with pytest.raises(AssertionError, match="carry a hash"):
        pool.check_invariants()

    pool = BlockPool(3, enable_caching=True)
    pool.free_queue.num_free_blocks += 1
    with pytest.raises(AssertionError, match="out of sync"):
        pool.check_invariants()
