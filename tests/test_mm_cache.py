"""Sender and receiver caches together: the prefix-cache/SHM trigger chain and its edges.

Images reach the segment the way the scheduler sends them: through the delivery ledger's
acquisition (pins, lookup or store, de-duplicated processing) and its step records; the
worker side is the real receiver cache. ``process`` stands in for the image processor
(it returns prepared items of controlled sizes, keyed by the media's uuid).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from scheduler_svc.delivery import DeliveryLedger
from scheduler_svc.output_text import OutputText
from scheduler_svc.request import Request, Sampling
from tandem.errors import FailedPrecondition
from tandem.features import FieldElem, MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from tandem.processor_cache import LruProcessorCache, ProcessorCache, ShmProcessorCache
from tandem.receiver_cache import ShmReceiverCache
from tandem.shm import ShmDescriptor
from tandem.strip import strip_covered_mm_data
from tandem.text import ByteTokenizer
from tandem.v1 import generate_pb2

KiB = 1024


def _item(seed: int, numel: int = 256) -> MultiModalKwargsItem:
    g = torch.Generator().manual_seed(seed)
    return MultiModalKwargsItem({
        "pixel_values": FieldElem(torch.randn(numel, generator=g)),
        "image_grid_thw": FieldElem(torch.tensor([[1, 2, 2]]), keep_on_cpu=True),
    })


def _request(rid: str, keys: list[str], spans: list[tuple[int, int]] | None = None) -> Request:
    spans = spans or [(i * 10, 4) for i in range(len(keys))]
    features = [MultiModalFeatureSpec(k, "image", PlaceholderRange(*s), None)
                for k, s in zip(keys, spans, strict=True)]
    sampling = Sampling(1, 0.0, 1.0, 0, None, frozenset(), False, frozenset())
    return Request(rid, [0] * 40, 40, features, sampling, cache_salt="",
                   text=OutputText(ByteTokenizer().incremental_decoder()),
                   media=[generate_pb2.MediaItem(uuid=k) for k in keys],
                   media_bytes=[0] * len(keys))


async def _inline(fn: Callable[[], MultiModalKwargsItem]) -> MultiModalKwargsItem:
    return fn()


class Sender:
    """The scheduler's side: a ledger over ``cache`` and the steps it sends."""

    def __init__(self, cache: ProcessorCache, items: dict[str, MultiModalKwargsItem]) -> None:
        self.items = items
        self.processed: list[str] = []
        self.ledger = DeliveryLedger(cache, self._process, _inline, lambda r, e: None)
        self.step_id = 0

    def _process(self, media: generate_pb2.MediaItem) -> MultiModalKwargsItem:
        self.processed.append(media.uuid)
        return self.items[media.uuid]

    def acquire(self, request: Request) -> list:
        asyncio.run(self.ledger.acquire(request))
        return [f.data for f in request.features]

    def send(self, request: Request) -> int:
        self.step_id += 1
        self.ledger.sent(self.step_id, [request])
        return self.step_id


@pytest.fixture
def shm(tmp_path: Path):
    cache = ShmProcessorCache(tmp_path, capacity=64 * KiB, n_readers=1, max_object_size=16 * KiB)
    yield cache
    cache.close()


def test_trigger_chain_hit_strip_resolve_then_evict(shm: ShmProcessorCache, tmp_path: Path) -> None:
    """vLLM #54994 end to end: a covered sender hit must still be acknowledged."""
    receiver = ShmReceiverCache(tmp_path, slot=0)
    writer = shm.writer
    sender = Sender(shm, {"A": _item(1)})
    # Request 1: miss, put, worker reads it.
    r1 = _request("r1", ["A"], [(1, 4)])
    (d1,) = sender.acquire(r1)
    assert isinstance(d1, ShmDescriptor)
    step = sender.send(r1)
    receiver.ensure_segment("features.seg", writer.generation)
    read = receiver.resolve(r1.features, 0, uses_mrope=False)
    assert writer.stats().unacked_refs == 1, "read, not yet acknowledged (step not accepted)"
    sender.ledger.check_invariants()
    assert receiver.acknowledge(read.to_ack) == 1
    sender.ledger.step_done(step)
    assert torch.equal(read.features[0].data["pixel_values"].data,
                       sender.items["A"]["pixel_values"].data)
    # Request 2: identical; the prefix cache covers the span, so the scheduler strips.
    r2 = _request("r2", ["A"], [(1, 4)])
    (d2,) = sender.acquire(r2)
    assert isinstance(d2, ShmDescriptor) and shm.counters().hits == 1
    assert sender.processed == ["A"], "a hit is not processed again"
    bound = strip_covered_mm_data(r2.features, 16, uses_mrope=False)
    assert bound[0].data is d2, "the address item must survive stripping"
    step = sender.send(r2)
    read = receiver.resolve(bound, 16, uses_mrope=False)
    assert read.features[0].data is None and (len(read.to_ack), read.resolved) == (1, 0)
    receiver.acknowledge(read.to_ack)
    sender.ledger.step_done(step)
    assert writer.stats().unacked_refs == 0
    sender.ledger.check_invariants()
    # Everything acknowledged: the object can be evicted and its space reused.
    reused = False
    for i in range(200):
        key = f"F{i}"
        sender.items[key] = _item(10 + i)
        r = _request(key, [key], [(1, 4)])
        (d,) = sender.acquire(r)
        step = sender.send(r)
        receiver.acknowledge(receiver.resolve(r.features, 0, uses_mrope=False).to_ack)
        sender.ledger.step_done(step)
        reused = d.address == d1.address
        if reused:
            break
    assert reused and not writer.is_cached("A")
    assert writer.stats().unacked_refs == 0
    writer.check_invariants()
    sender.ledger.check_invariants()
    receiver.close()


def test_stripped_raw_item_is_skipped_without_touching_counters(tmp_path: Path) -> None:
    cache = ShmProcessorCache(tmp_path, capacity=64 * KiB, n_readers=1, max_object_size=1 * KiB)
    try:
        sender = Sender(cache, {"big": _item(3, numel=2 * KiB)})
        request = _request("r", ["big"], [(0, 4)])
        (data,) = sender.acquire(request)
        assert isinstance(data, MultiModalKwargsItem), "oversize items travel inline"
        assert cache.counters().refused == {"oversize": 1}
        assert sender.ledger.stats().held == 0
        bound = strip_covered_mm_data(request.features, 16, False)
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
    sender = Sender(shm, {"A": _item(1)})
    request = _request("r", ["A"], [(0, 4)])
    sender.acquire(request)
    receiver = ShmReceiverCache(tmp_path, slot=0)
    receiver.ensure_segment("features.seg", shm.writer.generation)
    step = sender.send(request)
    out = receiver.resolve(request.features, 16, uses_mrope=True)
    assert list(out.features[0].data) == ["image_grid_thw"]
    assert (len(out.to_ack), out.resolved) == (1, 0)
    receiver.acknowledge(out.to_ack)
    sender.ledger.step_done(step)
    assert shm.writer.stats().unacked_refs == 0
    sender.ledger.check_invariants()
    receiver.close()


def test_aborted_request_releases_its_references(shm: ShmProcessorCache) -> None:
    sender = Sender(shm, {"A": _item(1), "B": _item(2)})
    request = _request("r", ["A", "B", "A"])
    data = sender.acquire(request)
    assert [isinstance(d, ShmDescriptor) for d in data] == [True, True, True]
    assert shm.writer.stats().unacked_refs == 3 and sender.ledger.stats().held == 3
    assert sender.processed == ["A", "B"], "the repeated image is a hit"
    sender.ledger.release(request)  # never delivered
    assert shm.writer.stats().unacked_refs == 0 and sender.ledger.stats().refs == 0
    assert not sender.ledger.deliverable(request)
    shm.writer.check_invariants()
    sender.ledger.check_invariants()


def test_a_failed_acquisition_keeps_nothing(shm: ShmProcessorCache) -> None:
    """The second image cannot be processed: the first one's reference is given back."""
    sender = Sender(shm, {"A": _item(1)})  # no item for "B": processing raises KeyError
    request = _request("r", ["A", "B"])
    with pytest.raises(KeyError):
        sender.acquire(request)
    assert shm.writer.stats().unacked_refs == 0 and sender.ledger.stats().held == 0
    sender.ledger.check_invariants()


def test_request_pins_protect_its_hits_from_its_own_puts(tmp_path: Path) -> None:
    """Our sizes for vLLM's test_cache_eviction_shm_cache: a hit survives the request's puts."""
    cache = ShmProcessorCache(tmp_path, capacity=40 * KiB, n_readers=1, max_object_size=16 * KiB)
    receiver = ShmReceiverCache(tmp_path, slot=0)
    receiver.ensure_segment("features.seg", cache.writer.generation)
    try:
        sender = Sender(cache, {k: _item(i, numel=3 * KiB) for i, k in enumerate("ABCGHIWXYZ")})

        def deliver(keys: list[str]) -> list:
            request = _request("-".join(keys), keys)
            data = sender.acquire(request)
            step = sender.send(request)
            receiver.acknowledge(receiver.resolve(request.features, 0, uses_mrope=False).to_ack)
            sender.ledger.step_done(step)
            return data

        deliver(["A", "B", "C"])  # fills the segment; all acknowledged
        data = deliver(["G", "A"])
        assert all(isinstance(d, ShmDescriptor) for d in data)
        # A was pinned by its own request: G took B's place, skipping A (no head-of-line block).
        assert [cache.writer.is_cached(k) for k in "ABCG"] == [True, False, True, True]
        deliver(["H", "I", "C"])  # C pinned: H and I reclaim A and G
        assert [cache.writer.is_cached(k) for k in "ACGHI"] == [False, True, False, True, True]
        # Four new items in one undelivered request: the fourth finds everything busy.
        request = _request("wxyz", list("WXYZ"))
        data = sender.acquire(request)
        assert [type(d) for d in data] == [ShmDescriptor] * 3 + [MultiModalKwargsItem]
        assert cache.counters().refused == {"full": 1}
        sender.ledger.release(request)
        assert cache.writer.stats().unacked_refs == 0
        cache.writer.check_invariants()
        sender.ledger.check_invariants()
    finally:
        receiver.close()
        cache.close()


def test_redelivery_and_first_processing_share_one_put(tmp_path: Path) -> None:
    """Fault 3 of issue 13: request B processes image X for the first time while request A,
    preempted after X was evicted, needs X again. One put serves both; neither hits
    DuplicateKey (which reached the client as INTERNAL)."""
    cache = ShmProcessorCache(tmp_path, capacity=40 * KiB, n_readers=1, max_object_size=16 * KiB)
    receiver = ShmReceiverCache(tmp_path, slot=0)
    receiver.ensure_segment("features.seg", cache.writer.generation)
    gate = asyncio.Event()
    items = {k: _item(i, numel=3 * KiB) for i, k in enumerate(["X", "F0", "F1", "F2"])}
    processed: list[str] = []

    def process(media: generate_pb2.MediaItem) -> MultiModalKwargsItem:
        processed.append(media.uuid)
        return items[media.uuid]

    async def gated(fn: Callable[[], MultiModalKwargsItem]) -> MultiModalKwargsItem:
        await gate.wait()
        return fn()

    redelivered: list[tuple[Request, BaseException | None]] = []

    async def main() -> None:
        ledger = DeliveryLedger(cache, process, gated,
                                lambda r, e: redelivered.append((r, e)))

        async def deliver(request: Request, step: int) -> None:
            gate.set()
            await ledger.acquire(request)
            gate.clear()
            ledger.sent(step, [request])
            receiver.acknowledge(receiver.resolve(request.features, 0, False).to_ack)
            ledger.step_done(step)

        a = _request("a", ["X"])
        await deliver(a, 1)
        for step, key in enumerate(["F0", "F1", "F2"], start=2):  # their puts evict X
            await deliver(_request(key, [key]), step)
        assert not cache.writer.is_cached("X")
        puts = cache.writer.stats().puts
        b = _request("b", ["X"])
        first = asyncio.create_task(ledger.acquire(b))
        await asyncio.sleep(0)  # B is processing X (held at the gate)
        assert not first.done()
        ledger.redeliver(a)  # A was preempted: its reference to X was spent
        await asyncio.sleep(0)
        assert not ledger.deliverable(a), "A waits for the processing under way"
        gate.set()
        await first
        await until_done(redelivered)
        assert redelivered == [(a, None)] and ledger.deliverable(a) and ledger.deliverable(b)
        assert cache.writer.stats().puts == puts + 1 and processed.count("X") == 2
        da, db = a.features[0].data, b.features[0].data
        assert isinstance(da, ShmDescriptor) and isinstance(db, ShmDescriptor)
        assert (da.address, da.monotonic_id) == (db.address, db.monotonic_id)
        assert ledger.stats().held == 2 and cache.writer.stats().unacked_refs == 2
        ledger.check_invariants()
        ledger.release(a)
        ledger.release(b)
        assert cache.writer.stats().unacked_refs == 0

    try:
        asyncio.run(main())
    finally:
        receiver.close()
        cache.close()


async def until_done(events: list) -> None:
    for _ in range(100):
        if events:
            return
        await asyncio.sleep(0)


def test_lru_cache_hits_and_evicts_by_bytes() -> None:
    item_bytes = _item(0).nbytes
    cache = LruProcessorCache(capacity_bytes=2 * item_bytes)
    items = {k: _item(i) for i, k in enumerate("ABC")}
    sender = Sender(cache, items)
    assert sender.acquire(_request("r1", ["A", "B"]))[0] is items["A"]
    assert cache.lookup("A") is items["A"]  # A is now most recent
    sender.acquire(_request("r2", ["C"]))  # evicts B
    assert cache.lookup("B") is None and cache.lookup("A") is items["A"]
    assert cache.used_bytes == 2 * item_bytes and sender.ledger.stats().refs == 0
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
