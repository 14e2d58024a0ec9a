"""Microbenchmark: SHM object store put+get next to memcpy and to inline bytes over gRPC.

For 1, 8 and 32 MiB objects, each round times (in rotating order, so drift hits all alike):
- memcpy: one copy into preallocated, faulted-in memory, rotating through a buffer as big as
  the segment so the destination is as cold in cache as the segment's (the DRAM bound);
- alloc+copy: one copy into freshly allocated bytes (what any copy-out pays in page faults);
- shm put+get: `ShmWriter.put` then `ShmReader.get` (copy in, copy out into fresh bytes);
- shm put+view: `put` then a zero-copy `view` and its acknowledgement;
- grpc inline: the bytes as the request of a loopback unary call (generic handler, no proto);
- empty rpc: the same call with 40 bytes, i.e. what a descriptor-only delivery costs.
Ratios are per-round ratios, then the median over rounds. Run: python bench/shm_store.py [--quick]
"""

import argparse
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

from tandem.shm import ShmReader, ShmWriter

MiB = 1 << 20


def environment(segment_dir: str, capacity: int, rounds: int) -> str:
    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return "n/a"

    cpu = next((line.split(":", 1)[1].strip() for line in read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor())
    malloc = " ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("MALLOC_"))
    return "\n".join([
        f"python {platform.python_version()}, grpcio {grpc.__version__}, {os.cpu_count()} cpus",
        f"cpu {cpu}, L3 {read('/sys/devices/system/cpu/cpu0/cache/index3/size')}",
        f"malloc env: {malloc or '(glibc defaults)'}",
        f"THP enabled: {read('/sys/kernel/mm/transparent_hugepage/enabled')}; "
        f"shmem: {read('/sys/kernel/mm/transparent_hugepage/shmem_enabled')}",
        f"segment in {segment_dir}, capacity {capacity // MiB} MiB, {rounds} rounds",
    ])


class LoopbackSink:
    """A gRPC server whose one unary method takes bytes and answers empty bytes."""

    def __init__(self) -> None:
        options = [("grpc.max_receive_message_length", -1),
                   ("grpc.max_send_message_length", -1)]
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
        handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"")
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("bench.Sink", {"Put": handler})])
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
        self.call = self.channel.unary_unary("/bench.Sink/Put")

    def close(self) -> None:
        self.channel.close()
        self.server.stop(None)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_size(size: int, rounds: int, writer: ShmWriter, reader: ShmReader,
               sink: LoopbackSink, pool: memoryview) -> dict[str, list[float]]:
    src = os.urandom(size)
    counter = iter(range(1 << 62))
    slots = len(pool) // size

    def memcpy() -> None:
        start = next(counter) % slots * size
        pool[start : start + size] = src

    def put_get() -> None:
        reader.get(writer.put(f"{size}-{next(counter)}", [src]))

    def put_view() -> None:
        with reader.view(writer.put(f"{size}-{next(counter)}", [src])) as view:
            assert view.nbytes == size

    cases: dict[str, Callable[[], object]] = {
        "memcpy": memcpy, "alloc+copy": lambda: bytes(memoryview(src)),
        "shm put+get": put_get, "shm put+view": put_view,
        "grpc inline": lambda: sink.call(src), "empty rpc": lambda: sink.call(bytes(40))}
    names = list(cases)
    for fn in cases.values():  # warm-up: fault in buffers, connect, grow the allocator
        fn()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(timed(cases[name]))
    return times


def report(size: int, times: dict[str, list[float]]) -> list[str]:
    def ratio(a: str, *b: str) -> float:
        """Median over rounds of time(a) / sum of time(b...) in the same round."""
        return statistics.median(
            t / sum(times[name][r] for name in b) for r, t in enumerate(times[a]))

    lines = []
    for name, samples in times.items():
        median = statistics.median(samples)
        rate = "" if name == "empty rpc" else f"{size / median / 1e6:9.0f} MB/s"
        lines.append(f"  {name:<13} {median * 1e3:8.3f} ms {rate}")
    lines.append(
        f"  time ratios: put+get / memcpy {ratio('shm put+get', 'memcpy'):.2f}, "
        f"put+get / (memcpy + alloc+copy) {ratio('shm put+get', 'memcpy', 'alloc+copy'):.2f}, "
        f"grpc inline / put+get {ratio('grpc inline', 'shm put+get'):.2f}, "
        f"grpc inline / put+view {ratio('grpc inline', 'shm put+view'):.2f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, 128 MiB segment")
    args = parser.parse_args()
    rounds, capacity = (3, 128 * MiB) if args.quick else (11, 256 * MiB)
    segment_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    print(environment(segment_dir, capacity, rounds))
    sink = LoopbackSink()
    # NOTE: memoryview slice assignment is a memcpy; bytearray's is ~5x slower here
    pool = memoryview(bytearray(capacity))
    for start in range(0, capacity, 16 * MiB):  # fault it in, as the segment is
        pool[start : start + 16 * MiB] = bytes(16 * MiB)
    with tempfile.TemporaryDirectory(dir=segment_dir) as directory, \
            ShmWriter(Path(directory) / "bench.seg", capacity, 1, 64 * MiB) as writer, \
            ShmReader(writer.path, 0) as reader:
        try:
            for size in (1 * MiB, 8 * MiB, 32 * MiB):
                print(f"{size // MiB} MiB (medians)")
                print("\n".join(report(size, bench_size(size, rounds, writer, reader, sink, pool))))
        finally:
            sink.close()


if __name__ == "__main__":
    main()
