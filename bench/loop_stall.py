"""How long admitting a request with large images stops the scheduler's event loop.

A real worker process and an in-process engine (the one ``tandem serve`` runs); a
heartbeat coroutine wakes every millisecond and records the longest gap between two
wake-ups while requests carrying ``--images`` PNGs of about ``--mib`` MiB each are
admitted and run (hashing, header checks, decoding, the step). The longest gap is how
long every other request of the cell waited for the loop; the sum of the gaps over 10 ms
how long it was stopped in all. Run::

    python bench/loop_stall.py                    # 8 images of ~19.6 MiB, 3 rounds
    python bench/loop_stall.py --images 4 --mib 5 --rounds 1

Measured with ``--rounds 6`` on two shared CPUs (issue 22, item 4): with the hash and the
header check on the event loop, the longest stall per round was 177-229 ms; with them in
the image threads, 11-24 ms (what remains is the decoding threads' turns at the GIL).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import math
import multiprocessing
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.worker_client import WorkerPool
from tandem.processor_cache import ShmProcessorCache
from tandem.v1 import generate_pb2
from tandem_testing.cells import request
from worker_svc.config import WorkerConfig
from worker_svc.server import serve


def big_png(seed: int, mib: float) -> bytes:
    """A random RGB PNG of about ``mib`` MiB (noise does not compress)."""
    side = int(math.sqrt(mib * 2**20 / 3))
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=0)
    return buf.getvalue()


async def heartbeat(gaps: list[float], stop: asyncio.Event) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def measure(shm: Path, msgs: list[generate_pb2.GenerateRequest],
                  ) -> list[tuple[float, float]]:
    """Per request: (the longest gap between heartbeats, the sum of gaps over 10 ms)."""
    config = SchedulerConfig(shm_dir=str(shm), worker_addresses=(f"unix://{shm}/worker-0.sock",))
    cache = ShmProcessorCache(shm, 64 << 20, n_readers=1, max_object_size=16 << 20)
    workers = WorkerPool(list(config.worker_addresses))
    engine = Engine(config, cache, workers)
    worst = []
    try:
        await engine.start()
        for msg in msgs:
            gaps: list[float] = []
            stop = asyncio.Event()
            beat = asyncio.create_task(heartbeat(gaps, stop))
            await asyncio.sleep(0.05)
            async for _ in engine.generate(msg):
                pass
            stop.set()
            await beat
            worst.append((max(gaps), sum(g for g in gaps if g > 0.01)))
    finally:
        await engine.stop()
        await workers.close()
        cache.close()
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--mib", type=float, default=19.6)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    images = [[big_png(r * 100 + i, args.mib) for i in range(args.images)]
              for r in range(args.rounds)]  # distinct per round: every round misses the cache
    # Built here: copying the images into a message is the client's (or gRPC's) work.
    msgs = [request("<image>" * args.images + f" round {r}", round_images, max_tokens=2)
            for r, round_images in enumerate(images)]
    with tempfile.TemporaryDirectory() as tmp:
        shm = Path(tmp)
        worker = WorkerConfig(shm_dir=str(shm), kv_cache_bytes=16 << 20)
        proc = multiprocessing.get_context("spawn").Process(target=serve, args=(worker,))
        proc.start()
        try:
            while not (shm / "worker-0.sock").exists():
                time.sleep(0.1)
            worst = asyncio.run(measure(shm, msgs))
        finally:
            proc.terminate()
            proc.join(20)
    size = sum(map(len, images[0])) / 2**20
    print(f"{args.images} images, {size:.1f} MiB per request; per round, the longest "
          f"event-loop stall / all stalls over 10 ms (ms): "
          f"{', '.join(f'{w * 1000:.0f}/{t * 1000:.0f}' for w, t in worst)}")


if __name__ == "__main__":
    main()
