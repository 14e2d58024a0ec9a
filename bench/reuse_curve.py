"""Offline report on the SHARDS hit-ratio curve (tandem/reuse_curve.py): error, cost, memory.

One run prints, with the environment:
- accuracy: on Zipf(0.9), Zipf(0.6), a loop and a mixed trace (100k references), the
  estimate next to the exact LRU-by-bytes curve at 1%..100% of the working set, for three
  configurations (fixed R = 0.1, the default R = 1 / 8,192 keys, and 1,024 keys); with
  ``--salts N`` also the mean and worst mean absolute error over N hash salts;
- cost per observe (sampled and unsampled) next to a dict update, the floor of any
  per-reference bookkeeping in Python;
- memory retained by the estimator after 1M distinct keys, next to its documented bound;
- the ``shm`` ring: the real ShmWriter (one reader acknowledging every delivery) replaying a
  Zipf trace, its hit ratio next to exact LRU, exact FIFO by bytes and the estimate.
The traces and the exact simulation are the tests' (tests/test_reuse_curve.py).
Run: python bench/reuse_curve.py [--salts 20] [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from tandem.reuse_curve import ReuseCurve, ReuseCurveConfig
from tandem.shm import ShmReader, ShmWriter
from tandem.shm.segment import CHUNK_ALIGN, chunk_header_size, round_up
from tandem_testing.reuse_traces import (
    FRACTIONS,
    Trace,
    estimate,
    exact_curve,
    loop_trace,
    mean_abs_error,
    mixed_trace,
    working_set,
    zipf_trace,
)

CONFIGS = {
    "R=0.1": ReuseCurveConfig(rate=0.1, max_keys=100_000),
    "default": ReuseCurveConfig(),
    "1024 keys": ReuseCurveConfig(rate=1.0, max_keys=1024),
}


def environment() -> str:
    cpu = next((line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    load = os.getloadavg()[0]
    return (f"python {platform.python_version()}, {os.cpu_count()} cpus, cpu {cpu}, "
            f"load average {load:.1f}")


LOOP_FRACTIONS = (0.8, 0.9, 0.95, 0.98, 1.02, 1.05, 1.1, 1.2)  # around the loop's bytes


def traces(references: int, salt: str) -> dict[str, tuple[Trace, tuple[float, ...]]]:
    """name -> (trace, capacities as fractions of its working set); loops use LOOP_FRACTIONS."""
    images = references * 2 // 5  # the loop: 40k images, 2.5 passes at 100k references
    loop, _ = loop_trace(images, 3, seed=2, salt=salt)
    return {
        "zipf 0.9, 20k images": (zipf_trace(references, 20_000, 0.9, 1, salt), FRACTIONS),
        "zipf 0.6, 20k images": (zipf_trace(references, 20_000, 0.6, 1, salt), FRACTIONS),
        f"loop of {images // 1000}k images": (loop[:references], LOOP_FRACTIONS),
        "mixed (hot zipf + scan)": (mixed_trace(references, 4, salt), FRACTIONS),
    }


def step_error(curve: ReuseCurve, trace: Trace) -> float:
    """A loop's curve is one step at its bytes L, so its error is where the estimate puts
    it: |step / L - 1|, the step being where half the achievable hit ratio is reached."""
    step = curve.recommend(0.5, 1 << 62)
    return abs((step or 0) / working_set(trace) - 1.0)


def accuracy(references: int) -> None:
    print(f"\n## Accuracy: estimate vs exact LRU, {references} references "
          "(capacity as a fraction of the working set)")
    for name, (trace, fractions) in traces(references, "").items():
        capacities = [int(working_set(trace) * f) for f in fractions]
        exact = exact_curve(trace, capacities)
        loop = fractions is LOOP_FRACTIONS
        print(f"\n{name}: working set {working_set(trace) / 2**30:.1f} GiB")
        print("config        R       " + " ".join(f"{f:>6.0%}" for f in fractions)
              + ("   |step/L - 1|" if loop else "    MAE    max"))
        print("exact                 " + " ".join(f"{x:6.3f}" for x in exact))
        for label, config in CONFIGS.items():
            curve = estimate(trace, config)
            est = [r for _, r in curve.curve(capacities)]
            errors = [abs(e - x) for e, x in zip(est, exact, strict=True)]
            summary = f"{step_error(curve, trace):10.3f}" if loop else \
                f" {statistics.mean(errors):6.3f} {max(errors):6.3f}"
            print(f"{label:<12}{curve.sampling_rate:7.4f} " + " ".join(f"{e:6.3f}" for e in est)
                  + summary)


def salted_errors(references: int, salts: int) -> None:
    print(f"\n## Over {salts} hash salts, mean / worst: MAE of the curve (a loop: |step/L - 1|), "
          f"{references} refs")
    print(f"{'trace':<26}" + "".join(f"{label:>18}" for label in CONFIGS))
    rows: dict[str, dict[str, list[float]]] = {}
    for salt in range(salts):
        for name, (trace, fractions) in traces(references, f"{salt}/").items():
            capacities = [int(working_set(trace) * f) for f in fractions]
            exact = exact_curve(trace, capacities)
            for label, config in CONFIGS.items():
                curve = estimate(trace, config)
                error = step_error(curve, trace) if fractions is LOOP_FRACTIONS else \
                    mean_abs_error(curve, exact, capacities)
                rows.setdefault(name, {}).setdefault(label, []).append(error)
    for name, by_config in rows.items():
        print(f"{name:<26}" + "".join(f"{statistics.mean(e):>10.4f} / {max(e):.3f}"
                                      for e in by_config.values()))


def per_call(fn: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) / calls * 1e9


def cost(references: int) -> None:
    print(f"\n## Cost per reference (ns), {references} references of zipf 0.9, median of 5")
    trace = zipf_trace(references, 20_000, 0.9, seed=1)

    def baseline() -> None:
        last: dict[str, int] = {}
        for key, size in trace:
            last[key] = size

    def observe(config: ReuseCurveConfig) -> Callable[[], None]:
        def run() -> None:
            curve = ReuseCurve(config)
            for key, size in trace:
                curve.observe(key, size)
        return run

    variants = {"dict update (baseline)": baseline,
                "observe, R=0.01 (mostly unsampled)": observe(ReuseCurveConfig(rate=0.01)),
                "observe, R=0.1": observe(CONFIGS["R=0.1"]),
                "observe, R=1 (all sampled)": observe(ReuseCurveConfig(max_keys=100_000)),
                "observe, default (R=1, 8192 keys)": observe(ReuseCurveConfig())}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(5):  # rounds interleaved, so drift hits every variant alike
        for name, fn in variants.items():
            times[name].append(per_call(fn, len(trace)))
    base = statistics.median(times["dict update (baseline)"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<38}{median:8.0f} ns   {median / base:5.1f}x baseline")


def memory(distinct: int) -> None:
    print(f"\n## Memory retained after {distinct} distinct 64-character keys (tracemalloc)")
    for max_keys in (1024, 8192):
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        curve = ReuseCurve(ReuseCurveConfig(max_keys=max_keys))
        for i in range(distinct):
            curve.observe(f"{i:064x}", 1 << 20)
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        print(f"max_keys {max_keys:>5}: {held / 1e6:6.2f} MB, {held / max_keys:5.0f} B per "
              f"tracked key (key string included), R now {curve.sampling_rate:.5f}")


def fifo_hit_ratio(trace: Trace, capacity: int) -> float:
    """FIFO by bytes: a hit does not move the object; the oldest insertion goes first."""
    cache: OrderedDict[str, int] = OrderedDict()
    used = hits = 0
    for key, size in trace:
        if key in cache:
            hits += 1
            continue
        cache[key] = size
        used += size
        while used > capacity:
            used -= cache.popitem(last=False)[1]
    return hits / len(trace)


def ring_hit_ratio(trace: Trace, capacity: int, folder: str) -> float:
    """Replay through the real segment writer; the one reader acknowledges every delivery."""
    largest = max(size for _, size in trace)
    payload = memoryview(bytes(largest))
    with ShmWriter(Path(folder) / "bench.seg", capacity, 1, largest) as writer, \
            ShmReader(writer.path, 0) as reader:
        for key, size in trace:
            if writer.is_cached(key):
                reader.ack(writer.hit(key))
            else:
                reader.ack(writer.put(key, [payload[:size]]))
        stats = writer.stats()
    return stats.hits / len(trace)


def shm_ring(references: int) -> None:
    print(f"\n## The shm ring vs the LRU curve: {references} references to images of "
          "16..256 KiB, charged as the ring does (header + 64-byte alignment)")
    header = chunk_header_size(1)

    def charged(trace: Trace) -> Trace:
        return [(key, round_up(header + size // 32, CHUNK_ALIGN)) for key, size in trace]

    cases = {"zipf 0.9, 5k images": (charged(zipf_trace(references, 5000, 0.9, seed=9)),
                                     (0.02, 0.05, 0.1, 0.2, 0.4, 0.7)),
             "loop of 5k images": (charged(loop_trace(5000, 3, seed=9)[0]), (0.95, 1.02, 1.05))}
    print("trace                capacity   exact LRU  estimate  exact FIFO  shm ring  ring - LRU")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) \
            as folder:
        for name, (trace, fractions) in cases.items():
            curve = estimate(trace, ReuseCurveConfig())
            for fraction in fractions:
                capacity = round_up(int(working_set(trace) * fraction), CHUNK_ALIGN)
                lru = exact_curve(trace, [capacity])[0]
                ring = ring_hit_ratio(trace, capacity, folder)
                print(f"{name:<20}{fraction:>8.0%}   {lru:9.3f} {curve.hit_ratio(capacity):9.3f} "
                      f"{fifo_hit_ratio(trace, capacity):10.3f} {ring:9.3f} {ring - lru:+10.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--salts", type=int, default=0,
                        help="also rerun the accuracy traces with this many hash salts")
    parser.add_argument("--quick", action="store_true", help="20k references instead of 100k")
    args = parser.parse_args()
    references = 20_000 if args.quick else 100_000
    print(environment())
    accuracy(references)
    if args.salts:
        salted_errors(references, args.salts)
    cost(references)
    memory(100_000 if args.quick else 1_000_000)
    shm_ring(references // 2)


if __name__ == "__main__":
    main()
