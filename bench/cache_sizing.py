"""Cache sizing end to end: a Zipf image trace replayed against real cells (``tandem serve``,
the built-in tiny model, the ``shm`` cache) at the size the cell's own reuse curve
recommends and at half of it, the measured hit ratios next to the predicted ones.

1. Calibration: the trace against a cell whose segment holds every image (1 GiB): its
   CacheStats gives the recommended size R (the smallest reaching --mm-cache-target-fraction
   of the achievable hit ratio) and the achievable ratio itself, the limit any cache size
   approaches.
2. The same trace against a fresh cell at R, then at R / 2. Each one's measured hit ratio
   (CacheStats hits / lookups) is printed next to the prediction: its own curve at its
   capacity (the same trace gives the same curve), which cell R also predicted at R / 2.

The curve models LRU; the segment's ring evicts FIFO by bytes, a few points below it on
skewed reuse (docs/cache-sizing.md), so "measured - predicted" is expected a little
negative. Requests are sent one at a time (no pinning effects), one image each, as PNGs of
eight resolutions (48 to 288 image patches).
Run: python bench/cache_sizing.py [--requests 400] [--images 60] [--alpha 0.9]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

from tandem.v1 import generate_pb2
from tandem_testing.cells import Cell, png, request, running_cell
from tandem_testing.reuse_traces import zipf_trace

# (width, height) of the PNGs: processed sizes from ~113 KB to ~680 KB
RESOLUTIONS = ((112, 84), (140, 112), (168, 112), (168, 168), (224, 168), (224, 224),
               (252, 224), (280, 224))
UNBOUNDED = 1 << 30


def environment() -> str:
    cpu = next((line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"python {platform.python_version()}, {os.cpu_count()} cpus, cpu {cpu}, "
            f"load average {os.getloadavg()[0]:.1f}")


def trace(requests: int, images: int, alpha: float) -> list[bytes]:
    """The PNG of each request, Zipf(alpha) popularity over `images` distinct images."""
    pngs = [png(1000 + i, *RESOLUTIONS[i % len(RESOLUTIONS)]) for i in range(images)]
    return [pngs[int(key.rsplit("-", 1)[1])]
            for key, _ in zipf_trace(requests, images, alpha, seed=16)]


def replay(cell: Cell, images: list[bytes]) -> float:
    """Send every request in order; returns the seconds taken."""
    start = time.monotonic()
    for data in images:
        *_, last = cell.stub.Generate(request("<image> Describe it.", [data], max_tokens=1),
                                      timeout=120)
        assert last.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
    return time.monotonic() - start


def measured(stats: generate_pb2.CacheStatsResponse) -> float:
    return stats.mm_cache_hits_total / max(stats.mm_cache_hits_total
                                           + stats.mm_cache_misses_total, 1)


def at(stats: generate_pb2.CacheStatsResponse, factor: float) -> float:
    """The cell's curve at `factor` x its capacity (a point CacheStats reports)."""
    want = round(stats.mm_cache_capacity_bytes * factor)
    [ratio] = [p.hit_ratio for p in stats.mm_cache_curve if p.capacity_bytes == want]
    return ratio


def run_cell(tmp: Path, size: int, images: list[bytes]) -> tuple[generate_pb2.CacheStatsResponse,
                                                                float]:
    with running_cell(tmp, "--mm-cache-size", str(size), debug_invariants=False) as cell:
        seconds = replay(cell, images)
        return cell.stats(), seconds


def mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--images", type=int, default=60)
    p.add_argument("--alpha", type=float, default=0.9)
    args = p.parse_args()
    images = trace(args.requests, args.images, args.alpha)
    print(f"environment: {environment()}")
    print(f"trace: {args.requests} requests, one image each, Zipf({args.alpha}) over "
          f"{args.images} PNGs ({len(set(images))} referenced), tiny model, shm cache")
    with tempfile.TemporaryDirectory() as tmp:
        calibration, seconds_c = run_cell(Path(tmp) / "calibration", UNBOUNDED, images)
        recommended = calibration.mm_cache_recommended_bytes
        print(f"calibration at {mib(UNBOUNDED)}: {seconds_c:.1f} s; measured hit ratio "
              f"{measured(calibration):.3f}, achievable (estimated) "
              f"{calibration.mm_cache_achievable_hit_ratio:.3f}; working set (what it "
              f"stored) {mib(calibration.shm_used_bytes)}; recommended {mib(recommended)} "
              f"({recommended} bytes)")
        at_r, seconds_r = run_cell(Path(tmp) / "recommended", recommended, images)
        half, seconds_h = run_cell(Path(tmp) / "half", recommended // 2, images)
    print()
    print("| cache | capacity | predicted (LRU curve) | measured (shm ring) | measured - predicted"
          " | replay |")
    print("|---|---|---|---|---|---|")
    for label, stats, seconds in (("recommended", at_r, seconds_r), ("half", half, seconds_h)):
        predicted, got = at(stats, 1.0), measured(stats)
        print(f"| {label} | {mib(stats.mm_cache_capacity_bytes)} | {predicted:.3f} | "
              f"{got:.3f} | {got - predicted:+.3f} | {seconds:.1f} s |")
    print(f"| (achievable: unbounded) | - | {calibration.mm_cache_achievable_hit_ratio:.3f} | "
          f"{measured(calibration):.3f} | - | {seconds_c:.1f} s |")
    print(f"\ncell R's curve at R / 2: {at(at_r, 0.5):.3f} (cell R/2's own: {at(half, 1.0):.3f})")


if __name__ == "__main__":
    main()
