"""Synthetic image-reference traces and an exact LRU-by-bytes oracle, for the reuse-curve
tests (tests/test_reuse_curve.py) and benchmark (bench/reuse_curve.py).

The oracle is a plain LRU cache run once per capacity (:func:`exact_curve`), not a stack
distance computation, so it shares no logic with ``tandem.reuse_curve``.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from tandem.reuse_curve import ReuseCurve, ReuseCurveConfig

Trace = list[tuple[str, int]]
MiB = 1 << 20


def image_sizes(n: int, rng: random.Random) -> list[int]:
    """Processed-image sizes, log-uniform in 0.5..8 MiB (pixel tensors of varied resolution)."""
    return [int(2 ** rng.uniform(19, 23)) for _ in range(n)]


def zipf_trace(references: int, images: int, alpha: float, seed: int, salt: str = "") -> Trace:
    """References to ``images`` distinct images, popularity Zipf(``alpha``) by rank."""
    rng = random.Random(seed)
    sizes = image_sizes(images, rng)
    cumulative, total = [], 0.0
    for rank in range(images):
        total += 1.0 / (rank + 1) ** alpha
        cumulative.append(total)
    picks = rng.choices(range(images), cum_weights=cumulative, k=references)
    return [(f"{salt}zipf-{i}", sizes[i]) for i in picks]


def loop_trace(images: int, passes: int, seed: int, salt: str = "") -> tuple[Trace, int]:
    """The same ``images`` in the same order ``passes`` times; returns it and the loop's bytes."""
    sizes = image_sizes(images, random.Random(seed))
    keys = [f"{salt}loop-{i}" for i in range(images)]
    return [(k, s) for _ in range(passes) for k, s in zip(keys, sizes, strict=True)], sum(sizes)


def mixed_trace(references: int, seed: int, salt: str = "") -> Trace:
    """Half hot Zipf(0.9) over 2,000 images, half a scan looping over 8,000 others."""
    rng = random.Random(seed)
    hot = zipf_trace(references // 2, 2000, 0.9, seed, salt)
    scan, _ = loop_trace(8000, references // 2 // 8000 + 1, seed + 1, salt)
    trace, h, s = [], 0, 0
    while len(trace) < references:
        if rng.random() < 0.5 and h < len(hot):
            trace.append(hot[h])
            h += 1
        else:
            trace.append(scan[s])
            s += 1
    return trace


def exact_hit_ratio(trace: Trace, capacity: int) -> float:
    """Simulate an LRU cache of ``capacity`` bytes: insert on a miss, then evict the least
    recently used while over capacity (an object bigger than the cache evicts itself too)."""
    cache: OrderedDict[str, int] = OrderedDict()
    used = hits = 0
    for key, size in trace:
        if key in cache:
            hits += 1
            cache.move_to_end(key)
            continue
        cache[key] = size
        used += size
        while used > capacity:
            used -= cache.popitem(last=False)[1]
    return hits / len(trace)


def exact_curve(trace: Trace, capacities: Sequence[int]) -> list[float]:
    return [exact_hit_ratio(trace, c) for c in capacities]


def working_set(trace: Trace) -> int:
    """Bytes of all distinct keys (their last sizes)."""
    return sum(dict(trace).values())


def estimate(trace: Trace, config: ReuseCurveConfig) -> ReuseCurve:
    curve = ReuseCurve(config)
    for key, size in trace:
        curve.observe(key, size)
    return curve


def mean_abs_error(curve: ReuseCurve, exact: Sequence[float], capacities: Sequence[int]) -> float:
    estimated = [ratio for _, ratio in curve.curve(capacities)]
    return sum(abs(e - x) for e, x in zip(estimated, exact, strict=True)) / len(exact)


FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0)  # capacities, x the working set
