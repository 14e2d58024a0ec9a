"""The SHARDS hit-ratio curve (tandem/reuse_curve.py) against an exact LRU-by-bytes simulation.

The oracle is a plain LRU cache run once per capacity (:func:`exact_curve`), not a stack
distance computation, so it shares no logic with the estimator; one test ties it to the
production ``LruProcessorCache``. Error bounds are from docs/cache-sizing.md, measured over
20 hash salts (``python bench/reuse_curve.py --salts 20``); the traces here are seeded, so
every run checks the same numbers. The traces and the oracle are in
``tandem_testing.reuse_traces`` (bench/reuse_curve.py uses them too).
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import tracemalloc

import pytest

from tandem.reuse_curve import (
    BUCKETS_PER_OCTAVE,
    CurvePoint,
    ReuseCurve,
    ReuseCurveConfig,
    bucket_of,
    capacities_around,
    key_hash,
)
from tandem_testing.reuse_traces import (
    FRACTIONS,
    MiB,
    estimate,
    exact_curve,
    exact_hit_ratio,
    loop_trace,
    mean_abs_error,
    mixed_trace,
    working_set,
    zipf_trace,
)

# -- the model --------------------------------------------------------------------------------

def test_oracle_is_the_production_lru_cache() -> None:
    """The simulation the estimator is judged against counts what LruProcessorCache hits."""
    import torch

    from tandem.features import FieldElem, MultiModalKwargsItem
    from tandem.processor_cache import LruProcessorCache

    rng = random.Random(7)
    sizes = [rng.randrange(1 << 10, 64 << 10) for _ in range(300)]
    picks = rng.choices(range(300), weights=[1 / (r + 1) for r in range(300)], k=4000)
    trace = [(f"img-{i}", sizes[i]) for i in picks]
    capacity = 2 << 20
    cache = LruProcessorCache(capacity)
    for key, size in trace:
        if cache.lookup(key) is None:
            pixels = FieldElem(torch.empty(size, dtype=torch.uint8))
            cache.store(key, MultiModalKwargsItem(pixel_values=pixels))
    production = cache.counters().hits / len(trace)
    assert production == exact_hit_ratio(trace, capacity)
    assert 0.3 < production < 0.9  # a capacity where eviction matters


def test_unsampled_estimate_is_exact_at_bucket_edges() -> None:
    """At R = 1 every distance is exact; only the histogram bucket loses resolution, so at a
    bucket's lower edge the estimate counts exactly the hits of the simulation, and between
    edges it is off by less than one bucket's hits."""
    trace = zipf_trace(20_000, 2000, 0.8, seed=3)
    curve = estimate(trace, ReuseCurveConfig(rate=1.0, max_keys=2000))
    assert curve.sampling_rate == 1.0
    capacities = [int(working_set(trace) * f) for f in FRACTIONS]
    edges = []
    for capacity in capacities:  # the lower edge of the bucket each capacity falls in
        octave, step = divmod(bucket_of(capacity) - 1, BUCKETS_PER_OCTAVE)
        edges.append(int(math.ldexp(1.0 + step / BUCKETS_PER_OCTAVE, octave)))
    for (edge, ratio), exact in zip(curve.curve(edges), exact_curve(trace, edges), strict=True):
        assert ratio == pytest.approx(exact, abs=1e-12), edge
    exact = exact_curve(trace, capacities)
    assert mean_abs_error(curve, exact, capacities) <= 0.002
    assert curve.achievable_hit_ratio() == pytest.approx(1 - len(dict(trace)) / len(trace))


def test_distance_is_in_bytes_and_a_size_change_takes_effect_at_its_reference() -> None:
    curve = ReuseCurve()
    for key, size in [("a", 10), ("b", 20), ("a", 10)]:  # second a: 10 + 20 = 30 bytes
        curve.observe(key, size)
        curve.check_invariants()
    assert curve.hit_ratio(29) == 0.0
    assert curve.hit_ratio(31) == pytest.approx(1 / 3)
    curve.observe("a", 50)  # a again, now 50 bytes: 50, nothing referenced since
    curve.observe("b", 20)  # 20 + a's new 50 = 70
    curve.check_invariants()
    assert curve.hit_ratio(49) == pytest.approx(1 / 5)
    assert curve.hit_ratio(51) == pytest.approx(2 / 5)
    assert curve.hit_ratio(69) == pytest.approx(2 / 5)
    assert curve.hit_ratio(72) == pytest.approx(3 / 5)
    assert curve.achievable_hit_ratio() == pytest.approx(3 / 5)


# -- accuracy under sampling ------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.9, 0.6])
def test_zipf_curve_at_rate_one_tenth(alpha: float) -> None:
    """100k references to 20k images, R = 0.1 (about 2,000 sampled keys): the mean absolute
    error of the curve at 8 capacities from 1% to 100% of the working set, for 2 hash salts
    (a salt draws another sample of keys). Over 20 salts it averaged 0.018-0.022 with a
    worst of 0.052 (docs/cache-sizing.md), mostly at the smallest capacities, where few
    sampled keys fall inside a reuse distance."""
    errors = []
    for salt in ("", "s1/"):
        trace = zipf_trace(100_000, 20_000, alpha, seed=1, salt=salt)
        capacities = [int(working_set(trace) * f) for f in FRACTIONS]
        curve = estimate(trace, ReuseCurveConfig(rate=0.1, max_keys=100_000))
        assert curve.sampling_rate == 0.1
        errors.append(mean_abs_error(curve, exact_curve(trace, capacities), capacities))
        exact_achievable = 1 - len(dict(trace)) / len(trace)
        assert curve.achievable_hit_ratio() == pytest.approx(exact_achievable, abs=0.01)
    assert max(errors) <= 0.06 and sum(errors) / len(errors) <= 0.03, errors


def test_fixed_size_sampling_bounds_keys_and_keeps_the_error() -> None:
    """max_keys = 1024 on 20k distinct images: R falls to about 1024/20k, never more keys;
    the error over 20 salts averaged 0.019, worst 0.042."""
    trace = zipf_trace(100_000, 20_000, 0.9, seed=1)
    capacities = [int(working_set(trace) * f) for f in FRACTIONS]
    curve = ReuseCurve(ReuseCurveConfig(rate=1.0, max_keys=1024))
    most = 0
    for key, size in trace:
        curve.observe(key, size)
        most = max(most, curve.tracked_keys)
    curve.check_invariants()
    assert most == 1024
    assert 0.03 < curve.sampling_rate < 0.1
    assert mean_abs_error(curve, exact_curve(trace, capacities), capacities) <= 0.045


def test_loop_just_larger_than_the_cache_hits_nothing() -> None:
    """40,000 images looped 3 times: LRU hits nothing below the loop's bytes L, everything
    after the first pass above them. At R = 0.1 the estimated step sits where the sampled
    keys' bytes / R put it: a standard deviation of sqrt((1-R)/R * E[s^2]/E[s]^2 / keys),
    1.9% of L here, so 10% either side of L is 5 deviations away."""
    trace, loop = loop_trace(40_000, 3, seed=2)
    below, above = int(loop / 1.1), int(loop * 1.1)
    assert exact_curve(trace, [below, above]) == [0.0, pytest.approx(2 / 3)]
    curve = estimate(trace, ReuseCurveConfig(rate=0.1, max_keys=100_000))
    assert curve.hit_ratio(below) <= 0.01
    assert curve.hit_ratio(above) >= 2 / 3 - 0.01
    step = curve.recommend(0.5, 1 << 60)
    assert step is not None and 0.94 * loop <= step <= 1.06 * loop


def test_loop_with_the_default_config_is_sharp() -> None:
    """The default (R = 1 until 8,192 keys) on a 10,000-image loop: a 3% margin suffices."""
    trace, loop = loop_trace(10_000, 5, seed=2, salt="d/")
    curve = estimate(trace, ReuseCurveConfig())
    assert curve.tracked_keys == 8192
    assert curve.hit_ratio(int(loop / 1.03)) <= 0.01
    assert curve.hit_ratio(int(loop * 1.03)) >= 0.79  # exact: 1 - 1/5


def test_mixed_trace_with_the_default_config() -> None:
    """A hot set interleaved with a scan (a cliff where the scan starts to fit), with the
    config the scheduler runs: over 20 salts the error averaged 0.003, worst 0.009."""
    trace = mixed_trace(100_000, seed=4)
    capacities = [int(working_set(trace) * f) for f in FRACTIONS]
    curve = estimate(trace, ReuseCurveConfig())
    assert curve.sampling_rate < 1.0  # 10,000 distinct images: sampled
    assert mean_abs_error(curve, exact_curve(trace, capacities), capacities) <= 0.015


# -- bounded memory, invariants, recommendation, snapshot ----------------------------------------

def retained_bytes(references: int, max_keys: int) -> tuple[int, int]:
    """Bytes the estimator holds after a stream of all-distinct keys, and its most tracked."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        curve, most = ReuseCurve(ReuseCurveConfig(rate=1.0, max_keys=max_keys)), 0
        for i in range(references):
            curve.observe(f"{i:064x}", 1 << 20)  # 64 characters, like an mm hash
            curve.observe(f"{i // 2:064x}", 1 << 20)  # and some reuse
            most = max(most, curve.tracked_keys)
        return tracemalloc.get_traced_memory()[0] - before, most
    finally:
        tracemalloc.stop()


def test_memory_is_bounded_whatever_the_trace_length() -> None:
    short, most_short = retained_bytes(3_000, max_keys=512)
    long, most_long = retained_bytes(30_000, max_keys=512)
    assert most_short == most_long == 512
    assert long <= 1.1 * short, (short, long)
    assert long <= 512 * (200 + 113) + 70_000, long  # class docstring: ~200 B/key + key + arrays


def test_invariants_hold_after_every_observe_through_rate_drops_and_compactions() -> None:
    trace = zipf_trace(1000, 300, 0.7, seed=5)
    curve = ReuseCurve(ReuseCurveConfig(rate=0.5, max_keys=30))
    for key, size in trace:
        curve.observe(key, size)
        curve.check_invariants()
    assert curve.sampling_rate < 0.2  # the rate fell
    assert curve.snapshot([]).sampled_references > 2 * 30  # so the 60 stamps were renumbered


def test_recommend() -> None:
    trace, loop = loop_trace(2000, 5, seed=6)
    curve = estimate(trace, ReuseCurveConfig())
    assert curve.achievable_hit_ratio() == pytest.approx(0.8)
    step = curve.recommend(0.95, 1 << 60)
    assert step is not None and 0.99 * loop <= step <= 1.01 * loop
    assert curve.hit_ratio(step) >= 0.95 * 0.8
    assert curve.recommend(0.95, loop // 2) == loop // 2  # bounded by the node's memory
    assert ReuseCurve().recommend(0.9, 1 << 30) is None  # nothing observed
    cold = estimate([(f"once-{i}", 100) for i in range(50)], ReuseCurveConfig())
    assert cold.recommend(0.9, 1 << 30) == 0  # no reuse: no capacity buys a hit
    for fraction in (0.0, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            curve.recommend(fraction, 1 << 30)


def test_snapshot_and_capacities_around() -> None:
    assert capacities_around(100 * MiB) == [25 * MiB, 50 * MiB, 100 * MiB, 200 * MiB, 400 * MiB]
    trace = zipf_trace(5000, 500, 0.9, seed=8)
    curve = estimate(trace, ReuseCurveConfig(rate=0.5))
    snap = curve.snapshot(capacities_around(working_set(trace) // 4))
    assert snap.references == 5000 and 0 < snap.sampled_references < 5000
    assert snap.sampling_rate == 0.5 and snap.tracked_keys == curve.tracked_keys
    ratios = [p.hit_ratio for p in snap.points]
    assert ratios == sorted(ratios) and ratios[0] > 0 and ratios[-1] <= snap.achievable_hit_ratio
    assert snap.points[2] == CurvePoint(working_set(trace) // 4, curve.hit_ratio(
        working_set(trace) // 4))
    assert snap.to_dict()["points"][0] == {"capacity_bytes": snap.points[0].capacity_bytes,
                                           "hit_ratio": ratios[0]}
    assert ReuseCurve().snapshot([1 << 20]).points == (CurvePoint(1 << 20, 0.0),)


def test_sampling_is_stable_across_processes() -> None:
    """The sampled set must not change at a restart: no per-process salted hash."""
    code = "from tandem.reuse_curve import key_hash; print(key_hash('zipf-0'), key_hash('x'))"
    seen = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                           capture_output=True, text=True, check=True, timeout=60).stdout
            for seed in ("1", "2")}
    assert seen == {f"{key_hash('zipf-0')} {key_hash('x')}\n"}


def test_bad_input_is_refused_with_a_message() -> None:
    with pytest.raises(ValueError, match="sampling rate"):
        ReuseCurveConfig(rate=0.0)
    with pytest.raises(ValueError, match="max_keys"):
        ReuseCurveConfig(max_keys=0)
    curve = ReuseCurve()
    with pytest.raises(ValueError, match="object size"):
        curve.observe("a", -1)
    with pytest.raises(ValueError, match="capacity"):
        curve.curve([-1])
    assert curve.references == 0
