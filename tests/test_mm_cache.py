"""Sender and receiver caches together: the prefix-cache/SHM trigger chain and its edges."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.errors import FailedPrecondition
from tandem.features import FieldElem, MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from tandem.processor_cache import LruProcessorCache, ProcessorCache, ShmProcessorCache
from tandem.receiver_cache import ShmReceiverCache
from tandem.shm import ShmDescriptor
from tandem.strip import strip_covered_mm_data

KiB = 1024


def _item(seed: int, numel: int = 256) -> MultiModalKwargsItem:
    g = torch.Generator().manual_seed(seed)
    return MultiModalKwargsItem({
        "pixel_values": FieldElem(torch.randn(numel, generator=g)),
        "image_grid_thw": FieldElem(torch.tensor([[1, 2, 2]]), keep_on_cpu=True),
    })


def _acquire(
    cache: ProcessorCache, keys: list[str], items: dict[str, MultiModalKwargsItem]
) -> list:
    """What the scheduler does per delivery: pin all keys, then look up or store each."""
    out = []
    with cache.pinned(keys):
        for key in keys:
            data = cache.lookup(key)
            out.append(data if data is not None else cache.store(key, items[key]))
    return out


def _features(
    data: list, spans: list[tuple[int, int]], keys: list[str]
) -> list[MultiModalFeatureSpec]:
    return [MultiModalFeatureSpec(k, "image", PlaceholderRange(*s), d)
            for k, s, d in zip(keys, spans, data, strict=True)]


@pytest.fixture
def shm(tmp_path: Path):
    cache = ShmProcessorCache(tmp_path, capacity=64 * KiB, n_readers=1, max_object_size=16 * KiB)
    yield cache
    cache.close()


def test_trigger_chain_hit_strip_resolve_then_evict(shm: ShmProcessorCache, tmp_path: Path) -> None:
    """vLLM #54994 end to end: a covered sender hit must still be acknowledged."""
    receiver = ShmReceiverCache(tmp_path, slot=0)
    writer = shm.writer
    items = {"A": _item(1)}
    # Request 1: miss, put, worker reads it.
    (d1,) = _acquire(shm, ["A"], items)
    assert isinstance(d1, ShmDescriptor)
    receiver.ensure_segment("features.seg", writer.generation)
    r1 = receiver.resolve(_features([d1], [(1, 4)], ["A"]), 0, uses_mrope=False)
    assert writer.stats().unacked_refs == 1, "read, not yet acknowledged (step not accepted)"
    assert receiver.acknowledge(r1.to_ack) == 1
    assert torch.equal(r1.features[0].data["pixel_values"].data, items["A"]["pixel_values"].data)
    # Request 2: identical; the prefix cache covers the span, so the scheduler strips.
    (d2,) = _acquire(shm, ["A"], items)
    assert isinstance(d2, ShmDescriptor) and shm.counters().hits == 1
    bound = strip_covered_mm_data(_features([d2], [(1, 4)], ["A"]), 16, uses_mrope=False)
    assert bound[0].data is d2, "the address item must survive stripping"
    assert writer.stats().unacked_refs == 1
    r2 = receiver.resolve(bound, 16, uses_mrope=False)
    assert r2.features[0].data is None and (len(r2.to_ack), r2.resolved) == (1, 0)
    receiver.acknowledge(r2.to_ack)
    assert writer.stats().unacked_refs == 0
    # Everything acknowledged: the object can be evicted and its space reused.
    reused = False
    for i in range(200):
        key = f"F{i}"
        (d,) = _acquire(shm, [key], {key: _item(10 + i)})
        receiver.acknowledge(receiver.resolve(_features([d], [(1, 4)], [key]), 0,
                                              uses_mrope=False).to_ack)
        reused = d.address == d1.address
        if reused:
            break
    assert reused and not writer.is_cached("A")
    assert writer.stats().unacked_refs == 0
    writer.check_invariants()
    receiver.close()


def test_stripped_raw_item_is_skipped_without_touching_counters(tmp_path: Path) -> None:
    cache = ShmProcessorCache(tmp_path, capacity=64 * KiB, n_readers=1, max_object_size=1 * KiB)
    try:
        (data,) = _acquire(cache, ["big"], {"big": _item(3, numel=2 * KiB)})
        assert isinstance(data, MultiModalKwargsItem), "oversize items travel inline"
        assert cache.counters().refused == {"oversize": 1}
        bound = strip_covered_mm_data(_features([data], [(0, 4)], ["big"]), 16, False)
        receiver = ShmReceiverCache(tmp_path, slot=0)
        receiver.ensure_segment("features.seg", cache.writer.generation)
        out = receiver.resolve(bound, 16, uses_mrope=False)
        assert out.features[0].data is None and out.to_ack == []
        assert cache.writer.stats().objects == 0
        receiver.close()
    finally:
        cache.close()


def test_mrope_covered_address_item_reads_only_cpu_fields(
    shm: ShmProcessorCache, tmp_path: Path
) -> None:
    (d,) = _acquire(shm, ["A"], {"A": _item(1)})
    receiver = ShmReceiverCache(tmp_path, slot=0)
    receiver.ensure_segment("features.seg", shm.writer.generation)
    out = receiver.resolve(_features([d], [(0, 4)], ["A"]), 16, uses_mrope=True)
    assert list(out.features[0].data) == ["image_grid_thw"]
    assert (len(out.to_ack), out.resolved) == (1, 0)
    receiver.acknowledge(out.to_ack)
    assert shm.writer.stats().unacked_refs == 0
    receiver.close()


def test_aborted_request_releases_its_references(shm: ShmProcessorCache) -> None:
    items = {"A": _item(1), "B": _item(2)}
    data = _acquire(shm, ["A", "B", "A"], items)
    assert [isinstance(d, ShmDescriptor) for d in data] == [True, True, True]
    assert shm.writer.stats().unacked_refs == 3
    for d in data:  # never delivered
        shm.release(d)
    assert shm.writer.stats().unacked_refs == 0
    shm.writer.check_invariants()


def test_request_pins_protect_its_hits_from_its_own_puts(tmp_path: Path) -> None:
    """Our sizes for vLLM's test_cache_eviction_shm_cache: a hit survives the request's puts."""
    cache = ShmProcessorCache(tmp_path, capacity=40 * KiB, n_readers=1, max_object_size=16 * KiB)
    receiver = ShmReceiverCache(tmp_path, slot=0)
    receiver.ensure_segment("features.seg", cache.writer.generation)
    try:
        items = {k: _item(i, numel=3 * KiB) for i, k in enumerate("ABCGHI")}  # ~12 KiB each

        def deliver(keys: list[str]) -> list:
            data = _acquire(cache, keys, items)
            feats = _features(data, [(i * 10, 4) for i in range(len(keys))], keys)
            receiver.acknowledge(receiver.resolve(feats, 0, uses_mrope=False).to_ack)
            return data

        deliver(["A", "B", "C"])  # fills the segment; all acknowledged
        data = deliver(["G", "A"])
        assert all(isinstance(d, ShmDescriptor) for d in data)
        # A was pinned by its own request: G took B's place, skipping A (no head-of-line block).
        assert [cache.writer.is_cached(k) for k in "ABCG"] == [True, False, True, True]
        deliver(["H", "I", "C"])  # C pinned: H and I reclaim A and G
        assert [cache.writer.is_cached(k) for k in "ACGHI"] == [False, True, False, True, True]
        # Four new items in one undelivered request: the fourth finds everything busy.
        data = _acquire(cache, list("WXYZ"), items | {k: _item(9, numel=3 * KiB) for k in "WXYZ"})
        assert [type(d) for d in data] == [ShmDescriptor] * 3 + [MultiModalKwargsItem]
        assert cache.counters().refused == {"full": 1}
        for d in data:
            cache.release(d)
        assert cache.writer.stats().unacked_refs == 0
        cache.writer.check_invariants()
    finally:
        receiver.close()
        cache.close()


def test_lru_cache_hits_and_evicts_by_bytes() -> None:
    item_bytes = _item(0).nbytes
    cache = LruProcessorCache(capacity_bytes=2 * item_bytes)
    items = {k: _item(i) for i, k in enumerate("ABC")}
    assert _acquire(cache, ["A", "B"], items)[0] is items["A"]
    assert cache.lookup("A") is items["A"]  # A is now most recent
    _acquire(cache, ["C"], items)  # evicts B
    assert cache.lookup("B") is None and cache.lookup("A") is items["A"]
    assert cache.used_bytes == 2 * item_bytes
    huge = MultiModalKwargsItem({"x": FieldElem(torch.zeros(10 * item_bytes))})
    assert cache.store("huge", huge) is huge and cache.lookup("huge") is None
    c = cache.counters()
    assert (c.hits, c.misses) == (2, 5)


def test_attaching_a_missing_segment_is_a_clear_precondition(tmp_path: Path) -> None:
    receiver = ShmReceiverCache(tmp_path, slot=0)
    with pytest.raises(FailedPrecondition) as err:
        receiver.ensure_segment("features.seg", 12345)
    assert err.value.reason == "SHM_SEGMENT_MISSING"
    assert receiver.generation == 0
