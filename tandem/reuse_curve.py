"""Online hit-ratio curve of a byte-sized LRU cache, in bounded memory (SHARDS sampling).

Why: the right size of a processor cache depends on the workload's reuse, which nobody
knows in advance. This estimator watches the stream of image references the cache sees
(key, size in bytes) and answers, for any capacity, the hit ratio that stream would have
had in an LRU cache of that many bytes; the scheduler exports a few points of it, and the
operator's sizing logic asks :meth:`ReuseCurve.recommend` for the smallest capacity worth
paying for. It is a pure data structure: no service, torch or grpc (docs/cache-sizing.md).

The model (LRU stack distance in bytes). The reuse distance of a reference to key k is the
size of k plus the sizes of the distinct other keys referenced since the previous reference
to k (infinite for a first reference: a cold miss). An LRU cache of C bytes holds at any
time the longest most-recently-used prefix of the recency stack that fits in C bytes, so
the reference hits exactly when its distance is <= C; one pass over the stream gives the
whole curve. The one divergence from ``tandem.processor_cache.LruProcessorCache``: that
cache bypasses an object larger than its capacity, where the model lets it flush the cache,
so the curve is exact for capacities of at least the largest object.

NOTE: the ``shm`` cache is not LRU. Its ring (``tandem/shm/store.py``) evicts in allocation
order and a hit does not move an object, so it behaves as FIFO by bytes (sizes charged as
a 64-byte aligned chunk header plus payload, and a run never wraps). Measured with the real
writer (``bench/reuse_curve.py``): its hit ratio equals exact FIFO by bytes within 0.001,
matches this curve exactly on a loop (nothing below the loop's bytes, everything above),
and on Zipf(0.9) sits 2 to 5 points below it: for the ring, read this curve as optimistic
by a few points on skewed reuse (not a bound in general: FIFO can beat LRU on some
streams). The rejected alternative, a FIFO curve: FIFO
has no inclusion property (a bigger FIFO cache can hit less), so there is no one-pass stack
distance for it; it would take one scaled-down simulation per capacity.

Sampling (SHARDS, Waldspurger et al., FAST'15). A key is in the sample when a 64-bit hash
of it is below a threshold T; the rate is R = T / 2**64, so each key is in or out for good
and a sampled key's every reference is seen. Distances are computed among sampled keys
only, the bytes of the other keys scaled by 1/R (the key's own size is known: added as is),
and each sampled reference stands for 1/R references (its weight, fixed when it is seen).
Fixed-size SHARDS bounds memory: once more than ``max_keys`` keys are tracked, the one with
the largest hash is dropped and T becomes its hash, so R falls as the number of distinct
keys grows and never rises. With the default
rate 1.0 the curve is exact, but for the spread of distances inside one histogram bucket,
until ``max_keys`` distinct keys were seen. Misses are estimated from the sample and divided
by the true reference count (SHARDS' "adj" correction: the gap between references and
sampled weight is credited as hits at the smallest distance), because a hot key that
happens to be in the sample (or out of it) moves the sampled weight a lot but the misses,
spread over many cold keys, little.

A key's size is its most recent observed size: a reference's distance is its own new size
plus the sizes the other keys had at their latest references; from then on, references of
other keys that reach back past it count its new size.

Cost: O(1) for a reference outside the sample (one hash), O(log max_keys) amortized inside
it (a Fenwick tree over access stamps weighted by size). Memory: see :class:`ReuseCurve`.
Not thread-safe: one owner (the scheduler's event loop) calls it.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

HASH_SPACE = 1 << 64  # hashes are 64-bit: R = threshold / HASH_SPACE
BUCKETS_PER_OCTAVE = 32  # histogram resolution: a bucket is at most 1/32 (3.1%) wide
N_BUCKETS = 1 + 64 * BUCKETS_PER_OCTAVE  # [0, 1) then 64 octaves: distances up to 2**64 bytes
MAX_SIZE = 1 << 40  # bytes per object: keeps every Fenwick sum inside a signed 64-bit word
AROUND_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)  # "capacities around the current one"


@dataclass(frozen=True, slots=True)
class ReuseCurveConfig:
    """``rate``: the initial sampling rate R in (0, 1]; ``max_keys``: tracked keys at most.

    Defaults: exact until 8,192 distinct images, then sampled; about 2.7 MB with
    64-character keys (docs/cache-sizing.md has the measured memory and error).
    """

    rate: float = 1.0
    max_keys: int = 8192

    def __post_init__(self) -> None:
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"sampling rate must be in (0, 1], got {self.rate}")
        if self.max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {self.max_keys}")


@dataclass(frozen=True, slots=True)
class CurvePoint:
    capacity_bytes: int
    hit_ratio: float  # estimated LRU hit ratio of the observed stream at that capacity


@dataclass(frozen=True, slots=True)
class CurveSnapshot:
    """What the scheduler exports (CacheStats fields, Prometheus gauges); plain numbers.

    Invariant: ``0 <= points[i].hit_ratio <= achievable_hit_ratio <= 1``, points ascending
    in capacity with non-decreasing hit ratio. Ratios are not additive across cells: a sum
    over cells weights each cell's ratios by its ``references``.
    """

    references: int  # image references observed since start
    sampled_references: int  # of them, in the sample when they were seen
    tracked_keys: int  # sampled keys held now (<= max_keys)
    sampling_rate: float  # current R
    achievable_hit_ratio: float  # infinite cache: 1 - cold misses / references
    points: tuple[CurvePoint, ...]

    def to_dict(self) -> dict[str, object]:
        return {
            "references": self.references,
            "sampled_references": self.sampled_references,
            "tracked_keys": self.tracked_keys,
            "sampling_rate": self.sampling_rate,
            "achievable_hit_ratio": self.achievable_hit_ratio,
            "points": [{"capacity_bytes": p.capacity_bytes, "hit_ratio": p.hit_ratio}
                       for p in self.points],
        }


def capacities_around(current_bytes: int,
                      factors: Sequence[float] = AROUND_FACTORS) -> list[int]:
    """The capacities worth reporting next to the configured one: ``current x factors``."""
    if current_bytes < 0:
        raise ValueError(f"capacity must be >= 0 bytes, got {current_bytes}")
    return sorted({round(current_bytes * f) for f in factors})


def key_hash(key: str) -> int:
    """The 64-bit hash that decides sampling: stable across processes and restarts.

    NOTE: blake2b rather than the built-in ``hash``: ``str`` hashing is salted per process
    (PYTHONHASHSEED), which would make the sampled set, and so the estimate, change at
    every restart and tests unrepeatable. It costs about a microsecond per reference.
    """
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest())


def bucket_of(distance: float) -> int:
    """Histogram bucket of a distance: 0 for [0, 1), then BUCKETS_PER_OCTAVE per octave."""
    if distance < 1.0:
        return 0
    mantissa, exponent = math.frexp(distance)  # distance = mantissa * 2**exponent, m in [.5, 1)
    index = 1 + (exponent - 1) * BUCKETS_PER_OCTAVE + int((2.0 * mantissa - 1.0)
                                                           * BUCKETS_PER_OCTAVE)
    return min(index, N_BUCKETS - 1)


class ReuseCurve:
    """SHARDS estimator of the LRU hit-ratio curve by bytes (module docstring: the model).

    Memory bound: at most ``max_keys`` tracked keys, each with one dict entry and one heap
    entry (and a reference to the caller's key string), plus fixed arrays of
    ``2 * max_keys`` stamps (8 bytes each, twice) and 3 x ``N_BUCKETS`` histogram doubles
    (49 KB), whatever the length of the stream: about 210 bytes per tracked key plus the
    key string (113 bytes for a 64-character one), 2.7 MB at the default 8,192 keys.

    Invariants (checked whole by :meth:`check_invariants`):
    - the tracked keys are exactly the heap's keys, at most ``max_keys`` of them, each with
      its hash below the threshold, and the heap is ordered (its top: the largest hash);
    - each tracked key owns one distinct stamp below the clock; ``_size_at`` is zero at
      every other stamp, and the Fenwick tree ``_tree`` holds the prefix sums of
      ``_size_at``, whose total is ``_live_bytes``;
    - histogram weights are non-negative and, with the cold weight, add up to the sampled
      weight; a bucket's smallest and largest distance lie in it when it has weight (else
      they are inf and 0); ``sampled <= references``.
    Only this class mutates its fields; the threshold only ever decreases.
    """

    def __init__(self, config: ReuseCurveConfig | None = None) -> None:
        self.config = config or ReuseCurveConfig()
        self._threshold = min(HASH_SPACE, math.ceil(self.config.rate * HASH_SPACE))
        self._references = 0
        self._sampled = 0
        self._sampled_weight = 0.0  # sum over sampled references of 1/R when seen
        self._cold_weight = 0.0  # the same, over first references of sampled keys
        self._histogram = array("d", bytes(8 * N_BUCKETS))  # bucket -> weight of re-references
        # NOTE: each bucket's smallest and largest distance seen, so a bucket's hits are
        # spread over what it holds rather than its whole width: a loop (every distance the
        # same) keeps a sharp step; finer buckets were the alternative (more to sweep).
        self._lowest = array("d", [math.inf]) * N_BUCKETS
        self._highest = array("d", [0.0]) * N_BUCKETS
        self._stamp_of: dict[str, int] = {}  # tracked key -> stamp of its latest reference
        self._heap: list[tuple[int, str]] = []  # (-hash, key): a max-heap on the hash
        self._slots = 2 * self.config.max_keys  # stamps before a compaction renumbers them
        self._size_at = array("q", bytes(8 * self._slots))  # stamp -> size of its key, or 0
        self._tree = array("q", bytes(8 * (self._slots + 1)))  # Fenwick over _size_at, 1-based
        self._clock = 0  # next stamp
        self._live_bytes = 0

    # -- the stream ---------------------------------------------------------------------------

    def observe(self, key: str, size: int) -> None:
        """Record one reference to ``key``, an object of ``size`` bytes (the hot path)."""
        if not 0 <= size <= MAX_SIZE:
            raise ValueError(f"object size must be in 0..{MAX_SIZE} bytes, got {size}")
        self._references += 1
        hashed = key_hash(key)
        if hashed < self._threshold:
            self._sample(key, hashed, size)

    def _sample(self, key: str, hashed: int, size: int) -> None:
        weight = HASH_SPACE / self._threshold  # 1/R
        self._sampled += 1
        self._sampled_weight += weight
        stamp = self._stamp_of.pop(key, None)  # popped: a compaction below skips the old stamp
        if stamp is None:
            self._cold_weight += weight
            heapq.heappush(self._heap, (-hashed, key))
        else:
            others = self._live_bytes - self._prefix(stamp + 1)  # tracked bytes since
            distance = size + others * weight
            bucket = bucket_of(distance)
            self._histogram[bucket] += weight
            if distance < self._lowest[bucket]:
                self._lowest[bucket] = distance
            if distance > self._highest[bucket]:
                self._highest[bucket] = distance
            self._add(stamp, -self._size_at[stamp])
        if self._clock == self._slots:
            self._compact()
        self._stamp_of[key] = self._clock
        self._add(self._clock, size)
        self._clock += 1
        if len(self._stamp_of) > self.config.max_keys:
            self._lower_rate()

    def _lower_rate(self) -> None:
        """Fixed-size SHARDS: drop the largest-hash keys; the threshold becomes that hash."""
        while len(self._stamp_of) > self.config.max_keys or \
                (self._heap and -self._heap[0][0] >= self._threshold):
            negated, key = heapq.heappop(self._heap)
            self._threshold = min(self._threshold, -negated)
            stamp = self._stamp_of.pop(key)
            self._add(stamp, -self._size_at[stamp])

    # -- Fenwick tree over stamps -------------------------------------------------------------

    def _add(self, stamp: int, delta: int) -> None:
        self._size_at[stamp] += delta
        self._live_bytes += delta
        i, tree, n = stamp + 1, self._tree, self._slots
        while i <= n:
            tree[i] += delta
            i += i & -i

    def _prefix(self, count: int) -> int:
        """Sum of ``_size_at[:count]``."""
        total, i, tree = 0, count, self._tree
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    def _compact(self) -> None:
        """Renumber the live stamps 0..n-1 in order and rebuild the tree: O(slots), and at
        least ``max_keys`` references apart, since at most ``max_keys`` stamps are live."""
        order = sorted(self._stamp_of.items(), key=lambda item: item[1])
        sizes = array("q", bytes(8 * self._slots))
        for new, (key, old) in enumerate(order):
            sizes[new] = self._size_at[old]
            self._stamp_of[key] = new
        self._size_at, self._clock = sizes, len(order)
        self._tree = _fenwick(sizes)

    # -- the curve ----------------------------------------------------------------------------

    @property
    def references(self) -> int:
        return self._references

    @property
    def sampling_rate(self) -> float:
        return self._threshold / HASH_SPACE

    @property
    def tracked_keys(self) -> int:
        return len(self._stamp_of)

    def achievable_hit_ratio(self) -> float:
        """Hit ratio of an infinite cache: 1 - cold misses / references (0 before any)."""
        if not self._references:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self._cold_weight / self._references))

    def hit_ratio(self, capacity_bytes: int) -> float:
        """Estimated LRU hit ratio of the stream so far at ``capacity_bytes``."""
        return self.curve([capacity_bytes])[0][1]

    def curve(self, capacities: Iterable[int]) -> list[tuple[int, float]]:
        """``(capacity, hit ratio)`` for each capacity, ascending; one sweep of the buckets."""
        wanted = sorted(capacities)
        if wanted and wanted[0] < 0:
            raise ValueError(f"capacity must be >= 0 bytes, got {wanted[0]}")
        if not self._references:
            return [(c, 0.0) for c in wanted]
        result, hits, masses = [], 0.0, self._masses()
        low, high, mass = next(masses, (math.inf, math.inf, 0.0))
        for capacity in wanted:
            while high <= capacity:
                hits += mass
                low, high, mass = next(masses, (math.inf, math.inf, 0.0))
            partial = mass * (capacity - low) / (high - low) if low < capacity else 0.0
            result.append((capacity, self._ratio(hits + partial)))
        return result

    def recommend(self, fraction: float, max_bytes: int) -> int | None:
        """Smallest capacity whose hit ratio reaches ``fraction`` of the achievable one,
        bounded by ``max_bytes``; None before any reference (no evidence either way).

        0 means no capacity buys a hit (every reference so far was a first one).
        """
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if not self._references:
            return None
        target = fraction * self.achievable_hit_ratio() * self._references  # in references
        if target <= 0.0:
            return 0
        hits = 0.0
        for low, high, mass in self._masses():
            if hits + mass >= target * (1.0 - 1e-12):  # float sums: 1 - 1e-12 of the target
                needed = low + (high - low) * max(0.0, target - hits) / mass
                return min(max_bytes, math.ceil(needed))
            hits += mass
        return max_bytes

    def snapshot(self, capacities: Iterable[int]) -> CurveSnapshot:
        return CurveSnapshot(
            references=self._references,
            sampled_references=self._sampled,
            tracked_keys=len(self._stamp_of),
            sampling_rate=self.sampling_rate,
            achievable_hit_ratio=self.achievable_hit_ratio(),
            points=tuple(CurvePoint(c, r) for c, r in self.curve(capacities)),
        )

    def _masses(self) -> Iterator[tuple[float, float, float]]:
        """``(smallest, largest distance, estimated hits)`` per non-empty bucket, ascending.

        The first one also carries the adj correction (references - sampled weight), so
        the masses add up to the references minus the estimated cold misses; a negative
        first mass (a hot key in the sample) is clipped away by :meth:`_ratio`.
        """
        correction = self._references - self._sampled_weight
        for index, weight in enumerate(self._histogram):
            if weight > 0.0:
                yield self._lowest[index], self._highest[index], weight + correction
                correction = 0.0

    def _ratio(self, hits: float) -> float:
        return min(self.achievable_hit_ratio(), max(0.0, hits / self._references))

    # -- checks -------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert every invariant of the class docstring (O(max_keys log max_keys))."""
        tracked = self._stamp_of
        assert len(tracked) <= self.config.max_keys, (len(tracked), self.config.max_keys)
        assert 0 < self._threshold <= HASH_SPACE, self._threshold
        assert sorted(k for _, k in self._heap) == sorted(tracked), "heap keys != tracked keys"
        for negated, key in self._heap:
            assert -negated == key_hash(key) < self._threshold, (key, -negated)
        heap = self._heap
        assert all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap))), "heap order"
        stamps = set(tracked.values())
        assert len(stamps) == len(tracked), "two keys share a stamp"
        assert all(0 <= s < self._clock <= self._slots for s in stamps), (self._clock, stamps)
        assert all(self._size_at[s] == 0 for s in range(self._slots) if s not in stamps)
        assert all(v >= 0 for v in self._size_at), "negative size"
        assert self._tree == _fenwick(self._size_at), "Fenwick tree != prefix sums of sizes"
        assert self._live_bytes == sum(self._size_at), (self._live_bytes, sum(self._size_at))
        for index, weight in enumerate(self._histogram):
            low, high = self._lowest[index], self._highest[index]
            if weight == 0.0:
                assert (low, high) == (math.inf, 0.0), (index, low, high)
            else:
                assert weight > 0.0 and bucket_of(low) == bucket_of(high) == index, \
                    (index, weight, low, high)
        recorded = sum(self._histogram) + self._cold_weight
        assert math.isclose(recorded, self._sampled_weight, rel_tol=1e-9), \
            (recorded, self._sampled_weight)
        assert 0 <= self._sampled <= self._references, (self._sampled, self._references)


def _fenwick(values: array[int]) -> array[int]:
    """The Fenwick tree (1-based) of ``values``, built in O(n)."""
    n = len(values)
    tree = array("q", bytes(8 * (n + 1)))
    for i in range(1, n + 1):
        tree[i] += values[i - 1]
        parent = i + (i & -i)
        if parent <= n:
            tree[parent] += tree[i]
    return tree
