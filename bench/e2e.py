"""End-to-end benchmark on real local cells (``tandem serve`` subprocesses).

Prints, from one run, with rounds interleaved so machine noise hits all variants alike:

* TTFT of a cold request vs the identical warm request (prefix + processor cache hits);
* TTFT of a request whose image is cached but whose prompt prefix is new, for the
  ``shm``, ``lru`` and ``none`` processor caches (what the processor cache alone saves);
* output tokens/s with 1, 4 and 16 concurrent clients.

Usage: ``python bench/e2e.py [--model small] [--rounds 5] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch

from tandem import __version__
from tandem_testing.cells import Cell, png, request, running_cell


def ttft(cell: Cell, msg) -> float:
    start = time.perf_counter()
    for out in cell.stub.Generate(msg, timeout=600):
        if out.token_ids:
            return time.perf_counter() - start
    raise RuntimeError("no token")


def cold_vs_warm(cell: Cell, rounds: int, side: int) -> tuple[list[float], list[float]]:
    cold, warm = [], []
    for r in range(rounds):
        prompt = f"Round {r}: describe <image> in detail, then say what stands out most."
        msg = request(prompt, [png(1000 + r, side, side)], max_tokens=1)
        cold.append(ttft(cell, msg))
        warm.append(ttft(cell, msg))
    return cold, warm


def cache_kinds(cells: dict[str, Cell], rounds: int, side: int) -> dict[str, list[float]]:
    """Same image every time, a new text prefix every time: only the processor cache helps."""
    image = png(7, side, side)
    for cell in cells.values():  # warm the image into each cache
        ttft(cell, request("warm up <image>", [image], max_tokens=1))
    out: dict[str, list[float]] = {k: [] for k in cells}
    for r in range(rounds):
        for kind, cell in cells.items():
            out[kind].append(ttft(cell, request(f"Variant {r} {kind}: <image>", [image],
                                                max_tokens=1)))
    return out


def throughput(cell: Cell, clients: int, tokens: int) -> float:
    done: list[int] = []

    def run(i: int) -> None:
        msg = request(f"Client {i} writes a story about the sea:", max_tokens=tokens,
                      ignore_eos=True)
        done.append(sum(len(m.token_ids) for m in cell.stub.Generate(msg, timeout=600)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - start)


def environment() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in lines
                if line.startswith("model name")), platform.processor())
    return (f"tandem {__version__}, python {platform.python_version()}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), grpcio {grpc.__version__}, cpu {cpu} "
            f"x{os.cpu_count()}, MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 rounds")
    args = ap.parse_args()
    model, rounds, side = (("tiny", 2, 224) if args.quick else (args.model, args.rounds, 448))
    tokens = 16 if args.quick else 32
    print(environment())
    print(f"model {model}, image {side}x{side}, {rounds} rounds, medians\n")
    with tempfile.TemporaryDirectory() as tmp:
        flags = ("--model", model, "--kv-cache-size", "256Mi")
        with running_cell(Path(tmp, "shm"), *flags) as shm, \
             running_cell(Path(tmp, "lru"), *flags, "--mm-cache", "lru") as lru, \
             running_cell(Path(tmp, "none"), *flags, "--mm-cache", "none") as none:
            cold, warm = cold_vs_warm(shm, rounds, side)
            med = statistics.median
            print(f"TTFT cold {1000 * med(cold):8.1f} ms   "
                  f"identical warm {1000 * med(warm):8.1f} ms"
                  f"   cold/warm = {med(c / w for c, w in zip(cold, warm, strict=True)):.2f}x")
            kinds = cache_kinds({"shm": shm, "lru": lru, "none": none}, rounds, side)
            base = med(kinds["none"])
            for kind, values in kinds.items():
                print(f"TTFT image cached, new prefix, cache={kind:<4} {1000 * med(values):8.1f} ms"
                      f"   none/{kind} = {base / med(values):.2f}x")
            single = None
            for clients in (1, 4, 16):
                tps = throughput(shm, clients, tokens)
                single = single or tps
                print(f"output tokens/s with {clients:2d} clients: {tps:8.1f}"
                      f"   vs 1 client = {tps / single:.2f}x")


if __name__ == "__main__":
    main()
