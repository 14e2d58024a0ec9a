"""Encoder-cache bookkeeping: references, freeable entries, FIFO eviction, freed hashes."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.encoder_cache import EncoderCacheManager

BIG_BUDGET = 1_000


def _encode(cache: EncoderCacheManager, rid: str, mm_hash: str, n: int) -> None:
    """What the scheduler does for an item it schedules for the encoder."""
    assert not cache.check_and_update_cache(rid, mm_hash)
    assert cache.can_allocate(n, BIG_BUDGET, 0)
    cache.allocate(rid, mm_hash, n)
    cache.check_invariants()


def test_allocate_then_reuse_by_another_request() -> None:
    cache = EncoderCacheManager(capacity=10)
    _encode(cache, "r1", "img", 4)
    assert "img" in cache
    assert cache.num_free_slots == 6 and cache.num_freeable_slots == 6
    assert cache.check_and_update_cache("r2", "img")
    cache.check_invariants()
    assert cache.num_free_slots == 6, "a hit takes no space"


def test_entry_becomes_freeable_after_the_last_reference() -> None:
    cache = EncoderCacheManager(capacity=10)
    _encode(cache, "r1", "img", 4)
    assert cache.check_and_update_cache("r2", "img")
    cache.free_encoder_input("r1", "img")
    cache.check_invariants()
    assert cache.num_freeable_slots == 6, "still referenced by r2"
    cache.free_encoder_input("r2", "img")
    cache.check_invariants()
    assert cache.num_freeable_slots == 10 and cache.num_free_slots == 6
    assert "img" in cache, "freeable entries stay on the workers until evicted"
    cache.free_encoder_input("r2", "img")  # a reference not held: no-op
    cache.free_encoder_input("r9", "never-seen")
    cache.check_invariants()
    assert cache.get_freed_mm_hashes() == []


def test_free_request_drops_all_its_references() -> None:
    cache = EncoderCacheManager(capacity=10)
    _encode(cache, "r1", "a", 3)
    _encode(cache, "r1", "b", 3)
    assert cache.check_and_update_cache("r2", "b")
    cache.free("r1")
    cache.check_invariants()
    assert cache.num_freeable_slots == 4 + 3, "a is freeable, b still used by r2"
    cache.free("r1")  # idempotent
    cache.free("unknown")
    cache.check_invariants()


def test_eviction_when_full_reports_each_hash_once() -> None:
    cache = EncoderCacheManager(capacity=10)
    _encode(cache, "r1", "a", 4)
    _encode(cache, "r1", "b", 4)
    cache.free("r1")
    cache.check_invariants()
    assert cache.can_allocate(6, BIG_BUDGET, 0)  # needs 6, 2 free: evicts "a" only
    cache.check_invariants()
    assert "a" not in cache and "b" in cache
    cache.allocate("r2", "c", 6)
    cache.check_invariants()
    assert cache.get_freed_mm_hashes() == ["a"]
    assert cache.get_freed_mm_hashes() == [], "cleared after read"
    assert not cache.check_and_update_cache("r3", "a")


def test_eviction_is_oldest_freed_first() -> None:
    cache = EncoderCacheManager(capacity=9)
    for name in "abc":
        _encode(cache, "r" + name, name, 3)
    for name in "cab":  # freed in this order
        cache.free("r" + name)
    assert cache.can_allocate(6, BIG_BUDGET, 0)
    cache.check_invariants()
    assert cache.get_freed_mm_hashes() == ["c", "a"]


def test_hit_revives_a_freeable_entry_so_it_is_not_evicted() -> None:
    cache = EncoderCacheManager(capacity=8)
    _encode(cache, "r1", "a", 4)
    _encode(cache, "r1", "b", 4)
    cache.free("r1")
    assert cache.check_and_update_cache("r2", "a")
    cache.check_invariants()
    assert cache.num_freeable_slots == 4
    assert cache.can_allocate(4, BIG_BUDGET, 0)
    cache.check_invariants()
    assert cache.get_freed_mm_hashes() == ["b"]
    assert not cache.can_allocate(1, BIG_BUDGET, 4), "a is in use, nothing more to evict"


def test_budget_and_space_refusals_evict_nothing() -> None:
    cache = EncoderCacheManager(capacity=10)
    _encode(cache, "r1", "a", 6)
    cache.free("r1")
    assert not cache.can_allocate(8, 7, 0), "over the step's encoder budget"
    assert not cache.can_allocate(6, BIG_BUDGET, 5), "with already scheduled items: 11 > 10"
    assert not cache.can_allocate(11, BIG_BUDGET, 0)
    cache.check_invariants()
    assert "a" in cache and cache.get_freed_mm_hashes() == []
    assert cache.can_allocate(4, BIG_BUDGET, 0), "fits in the free slots"
    assert "a" in cache


def test_allocating_a_held_hash_is_a_bug() -> None:
    cache = EncoderCacheManager(capacity=10)
    _encode(cache, "r1", "a", 2)
    with pytest.raises(ValueError, match="allocated twice"):
        cache.allocate("r2", "a", 2)
    with pytest.raises(ValueError, match="do not fit"):
        cache.allocate("r2", "b", 9)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_operations_keep_invariants_and_never_evict_used_entries(seed: int) -> None:
    rng = random.Random(seed)
    cache = EncoderCacheManager(capacity=20)
    users: dict[str, set[str]] = {}  # the test's own record: mm_hash -> requests using it
    for _ in range(200):
        rid, mm_hash = f"r{rng.randrange(5)}", f"h{rng.randrange(8)}"
        op = rng.randrange(3)
        if op == 0:
            if cache.check_and_update_cache(rid, mm_hash):
                users.setdefault(mm_hash, set()).add(rid)
            else:
                n = rng.randint(1, 8)
                if cache.can_allocate(n, rng.randint(0, 10), rng.randint(0, 4)):
                    cache.allocate(rid, mm_hash, n)
                    users[mm_hash] = {rid}
        elif op == 1:
            cache.free_encoder_input(rid, mm_hash)
            users.get(mm_hash, set()).discard(rid)
        else:
            cache.free(rid)
            for holders in users.values():
                holders.discard(rid)
        cache.check_invariants()
        for evicted in cache.get_freed_mm_hashes():
            assert evicted not in cache
            assert not users.pop(evicted), f"{evicted} evicted while in use"
    for rid in (f"r{i}" for i in range(5)):
        cache.free(rid)
    cache.check_invariants()
    assert cache.num_freeable_slots == cache.capacity
