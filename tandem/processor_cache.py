"""Processor caches on the scheduler side (the *sender* caches).

All three answer the same calls, made for every delivery of a request's images (first
schedule, and again after a preemption) by the scheduler's delivery ledger, their one
caller, which also owns what the references must become (``scheduler_svc/delivery.py``)::

    with cache.pinned(keys):           # all keys of the request, before any put
        for key in keys:
            data = cache.lookup(key)   # a hit: no processing needed
            if data is None:
                data = cache.store(key, process(key))

* ``shm``: processed items live in the cell's shared segment. A hit or a successful put
  returns an address item standing for one writer reference. When the segment refuses
  the object (full with everything busy, or over the per-object cap) the item travels
  inline, and the refusal is counted and logged.
* ``lru``: an in-process LRU of processed items; hits skip processing, data travels inline.
* ``none``: every image is processed every time.

Each cache also says what it charges for an object (:meth:`ProcessorCache.charge`, the
size the reuse curve of docs/cache-sizing.md must see) and why it did not keep one
(:meth:`ProcessorCache.refusal`, for the per-image attribution of a request's usage).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tandem.feature_codec import item_to_parts
from tandem.features import FeatureData, MultiModalKwargsItem
from tandem.shm import ShmDescriptor, ShmWriter
from tandem.shm import errors as shm_errors
from tandem.shm.segment import CHUNK_ALIGN, chunk_header_size, round_up

log = logging.getLogger(__name__)

SEGMENT_FILE = "features.seg"


@dataclass(frozen=True, slots=True)
class CacheCounters:
    hits: int
    misses: int
    refused: dict[str, int]  # reason -> puts that fell back to inline (shm only)


class ProcessorCache:
    """Base: the ``none`` cache, and the counters every cache keeps."""

    kind = "none"
    capacity = 0  # bytes the cache may hold

    def __init__(self) -> None:
        self._hits = 0
        self._misses = 0
        self._refused: Counter[str] = Counter()

    @contextmanager
    def pinned(self, keys: Iterable[str]) -> Iterator[None]:
        """Protect ``keys`` from eviction while a request's items are looked up and stored."""
        yield

    def lookup(self, key: str) -> FeatureData:
        """The cached data for ``key`` (counted as a hit), or None (counted as a miss)."""
        self._misses += 1
        return None

    def store(self, key: str, item: MultiModalKwargsItem) -> FeatureData:
        """Cache a freshly processed item; returns what travels to the workers."""
        return item

    def release(self, data: FeatureData) -> None:
        """Give back what :meth:`lookup`/:meth:`store` returned when it will never be delivered."""

    def charge(self, data: FeatureData) -> int:
        """Bytes this cache charges (or would charge) for the object ``data`` stands for:
        what a reference weighs in the reuse curve. Processed items weigh their tensors."""
        if not isinstance(data, MultiModalKwargsItem):
            raise TypeError(f"no processed object to charge: {type(data).__name__}")
        return data.nbytes

    def refusal(self, data: FeatureData) -> str:
        """Why the cache does not hold the object :meth:`store` returned as ``data``
        ("" when it does): ``none`` holds nothing ("disabled")."""
        return "disabled"

    def counters(self) -> CacheCounters:
        return CacheCounters(self._hits, self._misses, dict(self._refused))

    def close(self) -> None:
        """Release the cache's resources (the shm segment is unlinked)."""


class LruProcessorCache(ProcessorCache):
    """Processed items kept in this process, least recently used evicted past ``capacity`` bytes."""

    kind = "lru"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__()
        self.capacity = capacity_bytes
        self._items: OrderedDict[str, MultiModalKwargsItem] = OrderedDict()
        self._bytes = 0

    def lookup(self, key: str) -> FeatureData:
        item = self._items.get(key)
        if item is None:
            self._misses += 1
            return None
        self._hits += 1
        self._items.move_to_end(key)
        return item

    def store(self, key: str, item: MultiModalKwargsItem) -> FeatureData:
        if item.nbytes > self.capacity or key in self._items:
            return item  # too big to cache: served uncached
        self._items[key] = item
        self._bytes += item.nbytes
        while self._bytes > self.capacity:
            _, old = self._items.popitem(last=False)
            self._bytes -= old.nbytes
        return item

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def refusal(self, data: FeatureData) -> str:
        return "oversize" if self.charge(data) > self.capacity else ""


class ShmProcessorCache(ProcessorCache):
    """Sender side of the shared segment: the scheduler is its only writer.

    Every address item returned stands for one writer reference; :meth:`release` gives one
    back. Where each reference goes is the delivery ledger's (``scheduler_svc/delivery.py``).
    """

    kind = "shm"

    def __init__(self, shm_dir: str | Path, capacity: int, n_readers: int,
                 max_object_size: int, mode: int = 0o600) -> None:
        super().__init__()
        self.writer = ShmWriter(Path(shm_dir) / SEGMENT_FILE, capacity, n_readers,
                                max_object_size, mode=mode)
        self.capacity = self.writer.capacity  # rounded down to the chunk alignment

    @contextmanager
    def pinned(self, keys: Iterable[str]) -> Iterator[None]:
        keys = list(keys)
        self.writer.pin(keys)
        try:
            yield
        finally:
            self.writer.unpin(keys)

    def lookup(self, key: str) -> FeatureData:
        if not self.writer.is_cached(key):
            self._misses += 1
            return None
        self._hits += 1
        return self.writer.hit(key)

    def store(self, key: str, item: MultiModalKwargsItem) -> FeatureData:
        try:
            return self.writer.put(key, item_to_parts(item))
        except shm_errors.ObjectTooLarge:
            reason = "oversize"
        except shm_errors.SegmentFull:
            reason = "full"
        self._refused[reason] += 1
        log.info("image %s sent inline: segment refused it (%s, %d bytes)",
                 key[:16], reason, item.nbytes)
        return item

    def release(self, data: FeatureData) -> None:
        if isinstance(data, ShmDescriptor):
            self.writer.release(data)

    def charge(self, data: FeatureData) -> int:
        """The chunk the ring allocates: header and payload, rounded up to 64 bytes (for an
        item the segment refused, the chunk it would have taken)."""
        if isinstance(data, ShmDescriptor):
            nbytes = data.nbytes
        elif isinstance(data, MultiModalKwargsItem):
            nbytes = _encoded_nbytes(data)
        else:
            raise TypeError(f"no object to charge: {type(data).__name__}")
        return round_up(chunk_header_size(self.writer.n_readers) + nbytes, CHUNK_ALIGN)

    def refusal(self, data: FeatureData) -> str:
        """The reason :meth:`store` refused an item that came back inline: "oversize" when
        it can never fit (over the per-object cap or the whole segment), else "full"."""
        if isinstance(data, ShmDescriptor):
            return ""
        if (isinstance(data, MultiModalKwargsItem)
                and _encoded_nbytes(data) <= self.writer.max_object_size
                and self.charge(data) <= self.writer.capacity):
            return "full"
        return "oversize"

    def close(self) -> None:
        self.writer.close()


def _encoded_nbytes(item: MultiModalKwargsItem) -> int:
    """Payload bytes of ``item`` in the segment (its header, padding and tensors)."""
    return sum(memoryview(part).nbytes for part in item_to_parts(item))
