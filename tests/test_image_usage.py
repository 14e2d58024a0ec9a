"""Per-image attribution without a cell: what each processor cache charges and why it
refuses, what the delivery ledger records (and feeds the reuse curve) on every delivery,
and the encoder outcome the scheduler records per chunk, through preemption."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from scheduler_svc.delivery import DeliveryLedger
from scheduler_svc.encoder_cache import EncoderCacheManager
from scheduler_svc.image_usage import ImageRecord, record_encoder, usage_images
from scheduler_svc.kv_cache_manager import KVCacheManager
from scheduler_svc.output_text import OutputText
from scheduler_svc.request import Request, Sampling
from scheduler_svc.scheduler import Scheduler, SchedulerLimits
from tandem.features import FieldElem, MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from tandem.processor_cache import LruProcessorCache, ProcessorCache, ShmProcessorCache
from tandem.reuse_curve import ReuseCurve
from tandem.shm import ShmDescriptor
from tandem.text import ByteTokenizer
from tandem.text import byte_tokenizer as tokenizer
from tandem.v1 import generate_pb2 as pb

KiB = 1024


def _item(floats: int, seed: float = 1.0) -> MultiModalKwargsItem:
    return MultiModalKwargsItem({"pixel_values": FieldElem(torch.full((floats,), seed))})


def _request(rid: str, keys: list[str], spacing: int = 10, length: int = 4,
             tokens: list[int] | None = None) -> Request:
    features = [MultiModalFeatureSpec(k, "image", PlaceholderRange(i * spacing, length), None)
                for i, k in enumerate(keys)]
    ids = tokens if tokens is not None else [0] * (spacing * len(keys) + 4)
    sampling = Sampling(2, 0.0, 1.0, 0, None, frozenset(), False, frozenset())
    return Request(rid, ids, len(ids), features, sampling,
                   text=OutputText(ByteTokenizer().incremental_decoder()), cache_salt="",
                   media=[pb.MediaItem(uuid=k) for k in keys], media_bytes=[0] * len(keys))


async def _inline(fn: Callable[[], MultiModalKwargsItem]) -> MultiModalKwargsItem:
    return fn()


# -- what each cache charges and refuses ---------------------------------------------------------

def test_the_shm_cache_charges_the_chunk_the_ring_allocates(tmp_path: Path) -> None:
    cache = ShmProcessorCache(tmp_path, 64 * KiB, n_readers=2, max_object_size=16 * KiB)
    try:
        stored = cache.store("a", _item(1000))
        assert isinstance(stored, ShmDescriptor)
        assert cache.charge(stored) == cache.writer.stats().used_bytes  # the one chunk
        assert cache.refusal(stored) == ""
        big = _item(8 * KiB)  # 32 KiB of floats: over the 16 KiB cap
        assert cache.store("big", big) is big and cache.refusal(big) == "oversize"
        assert cache.charge(big) > 32 * KiB  # what the chunk would have taken
        cache.writer.pin(["a"])
        fillers = [cache.store(f"f{i}", _item(3000, float(i))) for i in range(6)]
        refused = [f for f in fillers if not isinstance(f, ShmDescriptor)]
        assert refused and {cache.refusal(f) for f in refused} == {"full"}  # refs outstanding
        assert cache.counters().refused == {"oversize": 1, "full": len(refused)}
        assert cache.capacity == 64 * KiB
    finally:
        cache.close()


def test_lru_and_none_charge_the_tensors() -> None:
    lru, none = LruProcessorCache(8 * KiB), ProcessorCache()
    small, big = _item(100), _item(4 * KiB)
    assert lru.charge(small) == none.charge(small) == 400
    assert lru.refusal(small) == "" and lru.refusal(big) == "oversize"
    assert none.refusal(small) == "disabled"
    assert (lru.capacity, none.capacity) == (8 * KiB, 0)
    with pytest.raises(TypeError):
        none.charge(None)


# -- the ledger: first delivery attributed, every delivery observed -----------------------------

def test_the_ledger_attributes_the_first_delivery_and_observes_every_one(tmp_path: Path) -> None:
    cache = ShmProcessorCache(tmp_path, 64 * KiB, n_readers=1, max_object_size=16 * KiB)
    sizes = {"A": 500, "B": 700, "huge": 8 * KiB}

    def process(media: pb.MediaItem) -> MultiModalKwargsItem:
        return _item(sizes[media.uuid])

    reuse = ReuseCurve()
    ledger = DeliveryLedger(cache, process, _inline, lambda r, e: None, reuse)
    try:
        first = _request("r1", ["A", "huge"])
        asyncio.run(ledger.acquire(first))
        second = _request("r2", ["B", "A", "huge"])
        asyncio.run(ledger.acquire(second))
        facts = [(r.cache, r.refused_reason, r.transport) for r in second.images]
        assert facts == [("miss", "", "shm"), ("hit", "", "shm"), ("refused", "oversize",
                                                                    "inline")]
        assert [(r.cache, r.transport) for r in first.images] == [("miss", "shm"),
                                                                 ("refused", "inline")]
        assert reuse.references == 5  # hits, misses and refusals alike
        charged = [cache.charge(f.data) for f in second.features]
        assert reuse.curve([sum(charged) * 2])[0][1] == pytest.approx(2 / 5)  # A and huge hit
        with pytest.raises(RuntimeError):
            second.images[0].delivered(True, second.features[0].data, "")  # written once
        ledger.sent(1, [second])
        ledger.step_done(1)

        async def preempted() -> None:  # fresh references, the attribution stays
            ledger.redeliver(second)
            while not ledger.deliverable(second):
                await asyncio.sleep(0)
        asyncio.run(preempted())
        assert reuse.references == 7 and second.images[0].cache == "miss"
        ledger.release(first)
        ledger.release(second)
        reuse.check_invariants()
    finally:
        cache.close()


# -- the encoder outcome, recorded where the scheduler commits a chunk --------------------------

def test_record_encoder_covers_what_the_chunk_reaches() -> None:
    r = _request("r", ["A", "B", "C"], spacing=10, length=4)
    record_encoder(r.images, r.features, computed=5, n=15, encode=[1])
    assert [i.encoder for i in r.images] == ["skipped", "ran", ""]  # A ends at 4; C from 20
    record_encoder(r.images, r.features, computed=20, n=5, encode=[])
    assert [i.encoder for i in r.images] == ["skipped", "ran", "cached"]
    # preempted, then recomputed from the start: the strongest outcome stays
    record_encoder(r.images, r.features, computed=0, n=30, encode=[0, 2])
    assert [i.encoder for i in r.images] == ["ran", "ran", "ran"]
    record_encoder(r.images, r.features, computed=30, n=5, encode=[])
    assert [i.encoder for i in r.images] == ["ran", "ran", "ran"]


def test_usage_images_count_the_placeholders_inside_the_prefix_hit() -> None:
    r = _request("r", ["A", "B", "C"], spacing=10, length=4)
    for image, (cache, transport) in zip(r.images, [("hit", "shm"), ("miss", "shm"),
                                                     ("refused", "inline")], strict=True):
        image.cache, image.transport = cache, transport
    r.images[2].refused_reason = "full"
    r.images[0].encoded("skipped")
    [a, b, c] = usage_images(r.images, num_cached_tokens=12)
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens) == (4, 2, 0)
    assert (a.tokens, a.key, a.encoder) == (4, "A", pb.ENCODER_RESULT_SKIPPED)
    assert (b.processor_cache, b.transport) == (pb.PROCESSOR_CACHE_RESULT_MISS,
                                                pb.IMAGE_TRANSPORT_SHM)
    assert (c.processor_cache, c.refused_reason, c.transport) == (
        pb.PROCESSOR_CACHE_RESULT_REFUSED, "full", pb.IMAGE_TRANSPORT_INLINE)
    assert c.encoder == pb.ENCODER_RESULT_UNSPECIFIED  # never scheduled
    assert usage_images(r.images, num_cached_tokens=-1)[0].cached_tokens == 0  # unscheduled
    assert ImageRecord("k", 0, 4).span_attributes(9) == {
        "tandem.mm.encoder.result": "unknown", "tandem.mm.cached_tokens": 4}


def test_the_scheduler_attributes_skipped_cached_and_ran() -> None:
    """Image X covered by the prefix a finished request cached, Y encoded by that request
    and still in the encoder cache (behind the divergence, so recomputed), Z new."""
    block = 4
    kv = KVCacheManager(64, block, True)
    sched = Scheduler(SchedulerLimits(8, 64, 64), kv, EncoderCacheManager(64), lambda r: True)
    img = tokenizer.IMAGE_ID
    first = _request("a", ["X", "Y"], tokens=[1, img, img, img, img, 5, 6, 7, 20, 21, img,
                                                  img, img, img, 9], spacing=0)
    first.features[:] = [MultiModalFeatureSpec("X", "image", PlaceholderRange(1, 4), None),
                         MultiModalFeatureSpec("Y", "image", PlaceholderRange(10, 4), None)]
    first.images[:] = [ImageRecord.of(f) for f in first.features]
    _run(sched, first)
    assert [i.encoder for i in first.images] == ["ran", "ran"]
    second = _request("b", ["X", "Y", "Z"], spacing=0, tokens=[
        1, img, img, img, img, 5, 6, 7, 30, 31, img, img, img, img, 40, img, img, img, img, 9])
    second.features[:] = [MultiModalFeatureSpec(k, "image", PlaceholderRange(o, 4), None)
                          for k, o in (("X", 1), ("Y", 10), ("Z", 15))]
    second.images[:] = [ImageRecord.of(f) for f in second.features]
    _run(sched, second)
    assert second.num_cached_tokens == 8  # two blocks: X inside, the rest diverges
    assert [i.encoder for i in second.images] == ["skipped", "cached", "ran"]
    assert [u.cached_tokens for u in usage_images(second.images, second.num_cached_tokens)] \
        == [4, 0, 0]


def _run(sched: Scheduler, request: Request) -> None:
    sched.add_request(request)
    while not request.is_finished:
        out = sched.schedule()
        sampled = {rid: [65] for rid in out.num_scheduled_tokens
                   if sched.requests[rid].num_computed_tokens + out.num_scheduled_tokens[rid]
                   >= sched.requests[rid].num_tokens}
        sched.update(out, sampled)
