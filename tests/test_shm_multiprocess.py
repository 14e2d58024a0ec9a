"""One writer (this process) and real reader processes (spawn) over the same segment file."""

import hashlib
import multiprocessing as mp
import random
import time
from collections.abc import Iterator
from dataclasses import astuple, dataclass
from multiprocessing.context import SpawnProcess
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import pytest
from shm_sender import sender_request

from tandem.shm import SegmentFull, ShmDescriptor, ShmError, ShmReader, ShmWriter
from tandem.shm.segment import chunk_header_size

SPAWN = mp.get_context("spawn")
TIMEOUT_S = 20.0


def _reader_main(commands: "Queue[tuple[Any, ...]]", results: "Queue[tuple[Any, ...]]") -> None:
    """A worker stand-in: attach to a slot, then copy out and acknowledge what it is sent."""
    reader: ShmReader | None = None
    while (command := commands.get())[0] != "stop":
        name, *args = command
        try:
            if name == "attach":
                if reader is not None:
                    reader.close()
                reader = ShmReader(args[0], args[1])
                results.put(("attached", reader.generation))
            elif name == "get":
                fields, delay_s = args
                time.sleep(delay_s)
                assert reader is not None
                data = reader.get(ShmDescriptor(*fields))
                results.put(("got", fields[2], hashlib.sha256(data).hexdigest()))
        except ShmError as exc:
            results.put(("error", type(exc).__name__, str(exc)))
    if reader is not None:
        reader.close()


@dataclass
class ReaderProcess:
    process: SpawnProcess
    commands: "Queue[tuple[Any, ...]]"
    results: "Queue[tuple[Any, ...]]"

    @classmethod
    def start(cls) -> "ReaderProcess":
        commands, results = SPAWN.Queue(), SPAWN.Queue()
        process = SPAWN.Process(target=_reader_main, args=(commands, results), daemon=True)
        process.start()
        return cls(process, commands, results)

    def attach(self, path: str, slot: int) -> tuple[Any, ...]:
        self.commands.put(("attach", path, slot))
        return self.results.get(timeout=TIMEOUT_S)

    def send(self, desc: ShmDescriptor, delay_s: float = 0.0) -> None:
        self.commands.put(("get", astuple(desc), delay_s))

    def collect(self, n: int) -> list[tuple[Any, ...]]:
        return [self.results.get(timeout=TIMEOUT_S) for _ in range(n)]

    def stop(self) -> None:
        self.commands.put(("stop",))
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@pytest.fixture(scope="module")
def pool() -> Iterator[list[ReaderProcess]]:
    procs = [ReaderProcess.start() for _ in range(4)]
    yield procs
    for proc in procs:
        proc.stop()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put_when_room(writer: ShmWriter, key: str, data: bytes) -> ShmDescriptor:
    """Retry while readers catch up, as the sender would before falling back to inline."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            return writer.put(key, [data])
        except SegmentFull:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.0005)


def test_two_reader_processes_follow_a_stream_larger_than_capacity(
        pool: list[ReaderProcess], tmp_path: Path) -> None:
    readers = pool[:2]
    rng = random.Random(3)
    with ShmWriter(tmp_path / "seg", 256 * 1024, 2, 64 * 1024) as writer:
        for slot, proc in enumerate(readers):
            assert proc.attach(writer.path, slot) == ("attached", writer.generation)
        expected = []
        for i in range(150):
            data = rng.randbytes(rng.randrange(1, 60 * 1024))
            desc = put_when_room(writer, f"k{i}", data)
            expected.append(("got", desc.monotonic_id, sha(data)))
            readers[0].send(desc)
            readers[1].send(desc, delay_s=0.0005)  # the slower worker
        for proc in readers:
            assert proc.collect(len(expected)) == expected
        stats = writer.stats()
        assert stats.unacked_refs == 0 and stats.evictions > 0
        writer.check_invariants()


@pytest.mark.parametrize("n_readers", [2, 4])
def test_protocol_ends_balanced_with_reader_processes_at_different_speeds(
        pool: list[ReaderProcess], tmp_path: Path, n_readers: int) -> None:
    x = random.Random(n_readers).randbytes(3000)
    with ShmWriter(tmp_path / "seg", 8192, n_readers, 8192) as writer:
        for slot in range(n_readers):
            pool[slot].attach(writer.path, slot)
        # put of X (request A) and hit (B) in one step; X twice in C; D aborted
        deliveries = sender_request(writer, ["X"], x) + sender_request(writer, ["X"], x)
        deliveries += sender_request(writer, ["X", "X"], x)
        for aborted in sender_request(writer, ["X"], x):
            writer.release(aborted)
        for slot in range(n_readers):
            for desc in deliveries:
                pool[slot].send(desc, delay_s=0.002 * slot)

        # hammer the writer with a put that needs X's space: it must not succeed before
        # every reader acknowledged, or a slower reader would fail with StaleDescriptor
        filler = bytes(writer.capacity - chunk_header_size(n_readers))
        writer.release(put_when_room(writer, "filler", filler))  # (its own ref is not wanted)
        assert not writer.is_cached("X")

        expected = [("got", deliveries[0].monotonic_id, sha(x))] * len(deliveries)
        for slot in range(n_readers):
            assert pool[slot].collect(len(deliveries)) == expected
        assert writer.stats().unacked_refs == 0
        writer.check_invariants()


def test_reader_process_holding_a_recreated_segment_gets_mismatch(
        pool: list[ReaderProcess], tmp_path: Path) -> None:
    proc = pool[0]
    crashed = ShmWriter(tmp_path / "seg", 4096, 1, 1024)
    try:
        desc = crashed.put("x", [b"old bytes"])
        proc.attach(crashed.path, 0)
        with ShmWriter(tmp_path / "seg", 4096, 1, 1024) as writer:
            proc.send(desc)
            kind, error, message = proc.collect(1)[0]
            assert (kind, error) == ("error", "SegmentMismatch") and "re-created" in message
            assert proc.attach(writer.path, 0) == ("attached", writer.generation)
            fresh = writer.put("x", [b"new bytes"])
            proc.send(fresh)
            assert proc.collect(1) == [("got", fresh.monotonic_id, sha(b"new bytes"))]
    finally:
        crashed.close()


def test_reset_reader_slot_frees_what_a_killed_reader_never_acknowledged(
        pool: list[ReaderProcess], tmp_path: Path) -> None:
    with ShmWriter(tmp_path / "seg", 4096, 2, 4096) as writer:
        pool[0].attach(writer.path, 0)
        doomed = ReaderProcess.start()
        try:
            doomed.attach(writer.path, 1)
            descs = [writer.put(f"k{i}", [bytes([i]) * 900]) for i in range(3)]
            doomed.send(descs[0])
            assert doomed.collect(1)[0][0] == "got"
        finally:
            doomed.process.kill()
            doomed.process.join()
        for desc in descs:
            pool[0].send(desc)
        assert [r[0] for r in pool[0].collect(3)] == ["got"] * 3
        with pytest.raises(SegmentFull):
            writer.put("big", [bytes(3000)])

        assert writer.reset_reader_slot(1) == 2
        assert writer.stats().unacked_refs == 0
        writer.put("big", [bytes(3000)])
        writer.check_invariants()
