"""ShmWriter / ShmReader in one process: round trip, limits, eviction, stale descriptors,
segment lifecycle, and the reference-count protocol with 1, 2 and 4 reader slots."""

import array
import dataclasses
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from shm_sender import sender_request

from tandem.shm import (
    DuplicateKey,
    ObjectTooLarge,
    SegmentCreateError,
    SegmentFull,
    SegmentMismatch,
    ShmDescriptor,
    ShmReader,
    ShmWriter,
    StaleDescriptor,
)
from tandem.shm.segment import H_VERSION, HEADER_SIZE, chunk_header_size

Store = tuple[ShmWriter, list[ShmReader]]
MakeStore = Callable[..., Store]


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[MakeStore]:
    opened: list[ShmWriter | ShmReader] = []

    def make(n_readers: int = 1, capacity: int = 4096, max_object_size: int = 4096) -> Store:
        writer = ShmWriter(tmp_path / f"seg{len(opened)}", capacity, n_readers, max_object_size)
        readers = [ShmReader(writer.path, slot) for slot in range(n_readers)]
        opened.extend([*readers, writer])
        return writer, readers

    yield make
    for obj in opened:
        obj.close()


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def full_object(writer: ShmWriter) -> bytes:
    """An object whose chunk spans the whole data area: it fits only if everything is evictable."""
    return bytes(writer.capacity - chunk_header_size(writer.n_readers))


def test_round_trip_of_parts(make_store: MakeStore) -> None:
    writer, (reader,) = make_store()
    floats = array.array("f", [1.5, -2.0, 3.25])
    parts: list[bytes | bytearray | memoryview] = [b"head", bytearray(b"-mid-"),
                                                   memoryview(floats)]
    expected = b"head-mid-" + floats.tobytes()

    desc = writer.put("x", parts)

    assert (desc.generation, desc.refs, desc.nbytes) == (writer.generation, 1, len(expected))
    assert desc.address % 64 == 0
    assert writer.read(desc) == expected  # writer-side copy acknowledges nothing
    assert writer.stats().unacked_refs == 1
    assert reader.get(desc) == expected
    assert writer.stats().unacked_refs == 0
    with reader.view(writer.hit("x")) as view:
        assert view.tobytes() == expected
    assert writer.stats().unacked_refs == 0
    assert (writer.stats().puts, writer.stats().hits) == (1, 1)
    writer.check_invariants()


def test_duplicate_and_oversize_leave_store_unchanged(make_store: MakeStore) -> None:
    writer, _ = make_store(capacity=4096, max_object_size=1000)
    writer.put("x", [payload(100)])
    before = (writer.stats(), Path(writer.path).read_bytes())

    with pytest.raises(DuplicateKey):
        writer.put("x", [b"other"])
    with pytest.raises(ObjectTooLarge, match="max object size is 1000"):
        writer.put("big", [bytes(1001)])

    assert (writer.stats(), Path(writer.path).read_bytes()) == before
    assert not writer.is_cached("big")
    writer.check_invariants()


def test_object_over_capacity_is_too_large(make_store: MakeStore) -> None:
    writer, _ = make_store(capacity=1024, max_object_size=10_000)
    with pytest.raises(ObjectTooLarge, match="holds 1024 bytes"):
        writer.put("x", [bytes(1024)])


def test_fill_raises_full_then_acks_reclaim_oldest_first(make_store: MakeStore) -> None:
    writer, (reader,) = make_store(capacity=4096)
    descs = [writer.put(f"k{i}", [payload(448, i)]) for i in range(8)]  # 8 x 512-byte chunks
    before = (writer.stats(), Path(writer.path).read_bytes())
    with pytest.raises(SegmentFull):
        writer.put("extra", [payload(448)])
    assert (writer.stats(), Path(writer.path).read_bytes()) == before

    reader.ack(descs[5])  # an acked object away from the cursor is reclaimed first
    writer.put("extra", [payload(448)])
    assert not writer.is_cached("k5") and writer.is_cached("k0")
    for d in descs[:3]:
        reader.ack(d)
    writer.put("next", [payload(448)])
    assert [writer.is_cached(f"k{i}") for i in range(3)] == [False, True, True]  # FIFO from 0
    assert writer.stats().evictions == 2
    writer.check_invariants()


def test_stream_larger_than_capacity_wraps_around(make_store: MakeStore) -> None:
    writer, readers = make_store(n_readers=2, capacity=8192, max_object_size=3000)
    rng = random.Random(7)
    pending: list[list[tuple[ShmDescriptor, bytes]]] = [[], []]
    total = 0
    for i in range(300):
        data = payload(rng.randrange(0, 3000), i)
        total += len(data)
        while True:
            try:
                desc = writer.put(f"k{i}", [data])
                break
            except SegmentFull:  # the lagging reader catches up, as a slow worker would
                slot = max((0, 1), key=lambda s: len(pending[s]))
                d, expected = pending[slot].pop(0)
                assert readers[slot].get(d) == expected
        for slot in (0, 1):
            pending[slot].append((desc, data))
        # reader 0 keeps up, reader 1 lags by up to three objects
        while pending[0]:
            d, expected = pending[0].pop(0)
            assert readers[0].get(d) == expected
        while len(pending[1]) > 3:
            d, expected = pending[1].pop(0)
            assert readers[1].get(d) == expected
        writer.check_invariants()
    assert total > 50 * writer.capacity
    assert writer.stats().evictions > 250


@pytest.mark.parametrize("blocker", ["pinned", "unacked"])
def test_busy_chunk_does_not_block_space_behind_it(make_store: MakeStore, blocker: str) -> None:
    writer, (reader,) = make_store(capacity=4096)
    descs = [writer.put(f"k{i}", [payload(960, i)]) for i in range(4)]  # 4 x 1024 bytes
    for d in descs[1:]:
        reader.ack(d)
    if blocker == "pinned":
        reader.ack(descs[0])
        writer.pin(["k0"])

    # the cursor wrapped to k0, which is busy: the ring skips it and evicts k1, k2
    writer.put("new", [payload(1500)])

    assert [writer.is_cached(f"k{i}") for i in range(4)] == [True, False, False, True]
    assert writer.read(descs[0]) == payload(960, 0)
    writer.check_invariants()
    with pytest.raises(SegmentFull):  # only k3 is left evictable: too small for 2 KiB
        writer.put("big", [payload(2000)])


def test_pinned_keys_and_unpin_errors(make_store: MakeStore) -> None:
    writer, (reader,) = make_store(capacity=1024)
    writer.pin(["a", "a"])  # pins nest, and may precede the put
    reader.ack(writer.put("a", [payload(900)]))
    assert writer.stats().pinned_objects == 1
    with pytest.raises(SegmentFull):
        writer.put("b", [payload(900)])
    with pytest.raises(ValueError, match="not pinned"):
        writer.unpin(["a", "a", "a"])
    writer.unpin(["a"])
    with pytest.raises(SegmentFull):
        writer.put("b", [payload(900)])
    writer.unpin(["a"])
    writer.put("b", [payload(900)])
    assert not writer.is_cached("a")
    writer.check_invariants()


def test_hit_of_absent_key_raises_key_error(make_store: MakeStore) -> None:
    writer, _ = make_store()
    with pytest.raises(KeyError):
        writer.hit("nope")


def _stale_variants(writer: ShmWriter, desc: ShmDescriptor) -> dict[str, ShmDescriptor]:
    return {
        "generation": dataclasses.replace(desc, generation=desc.generation ^ 1),
        "monotonic_id": dataclasses.replace(desc, monotonic_id=desc.monotonic_id + 1),
        "nbytes": dataclasses.replace(desc, nbytes=desc.nbytes + 1),
        "out_of_range": dataclasses.replace(desc, address=writer.capacity),
        "huge_address": dataclasses.replace(desc, address=2**64),
        "negative": dataclasses.replace(desc, address=-64),
        "misaligned": dataclasses.replace(desc, address=desc.address + 8),
        "huge_refs": dataclasses.replace(desc, refs=2**40),
        "zero_refs": dataclasses.replace(desc, refs=0),
        "bool_address": dataclasses.replace(desc, address=False),
    }


def test_stale_descriptors_change_no_counter(make_store: MakeStore) -> None:
    writer, (reader,) = make_store()
    writer.put("pad", [payload(100)])
    desc = writer.put("x", [payload(100, 1)])
    for name, bad in _stale_variants(writer, desc).items():
        before = Path(writer.path).read_bytes()
        calls = [reader.get, reader.ack, writer.release, writer.read]
        if name == "huge_refs":
            calls.pop()  # a writer-side read takes no refs, so refs cannot make it stale
        for call in calls:
            with pytest.raises(StaleDescriptor):
                call(bad)
            with pytest.raises(StaleDescriptor), reader.view(bad):
                pass
        assert Path(writer.path).read_bytes() == before, name
    assert reader.get(desc) == payload(100, 1)
    before = Path(writer.path).read_bytes()
    with pytest.raises(StaleDescriptor, match="over-acknowledge"):
        reader.ack(desc)  # a duplicate delivery
    assert Path(writer.path).read_bytes() == before


def test_descriptor_of_reused_chunk_is_stale(make_store: MakeStore) -> None:
    writer, (reader,) = make_store(capacity=1024)
    old = writer.put("a", [payload(900)])
    reader.ack(old)
    new = writer.put("b", [payload(900, 1)])
    assert new.address == old.address and new.monotonic_id > old.monotonic_id
    before = Path(writer.path).read_bytes()
    with pytest.raises(StaleDescriptor, match="evicted and reused"):
        reader.get(old)
    assert Path(writer.path).read_bytes() == before
    assert reader.get(new) == payload(900, 1)


def test_descriptor_standing_for_several_refs_is_acked_once(make_store: MakeStore) -> None:
    writer, readers = make_store(n_readers=2, capacity=1024)
    first = writer.put("a", [payload(900)])
    merged = dataclasses.replace(writer.hit("a"), refs=2)  # a caller may merge deliveries
    writer.hit("a")
    for reader in readers:
        reader.ack(first)
    assert writer.stats().unacked_refs == 2
    for reader in readers:
        with pytest.raises(StaleDescriptor, match="over-acknowledge"):
            reader.ack(dataclasses.replace(merged, refs=3))
    readers[0].ack(merged)
    assert writer.stats().unacked_refs == 2  # the slowest slot still owes both
    assert readers[1].get(merged) == payload(900)
    assert writer.stats().unacked_refs == 0
    writer.put("b", [full_object(writer)])


def test_release_undoes_a_reference(make_store: MakeStore) -> None:
    writer, (reader,) = make_store(capacity=1024)
    put = writer.put("a", [payload(900)])
    aborted = writer.hit("a")
    writer.release(aborted)
    assert writer.stats().unacked_refs == 1
    reader.ack(put)
    with pytest.raises(StaleDescriptor, match="cannot release"):
        writer.release(put)  # already acknowledged: releasing would under-run the acks
    assert writer.stats().unacked_refs == 0
    writer.put("b", [full_object(writer)])
    assert not writer.is_cached("a")


def test_put_then_release_is_reclaimable(make_store: MakeStore) -> None:
    writer, _ = make_store(n_readers=2, capacity=1024)
    writer.release(writer.put("a", [payload(900)]))
    writer.put("b", [full_object(writer)])
    writer.check_invariants()


def test_reset_reader_slot_forgives_a_dead_reader(make_store: MakeStore) -> None:
    writer, readers = make_store(n_readers=2, capacity=4096)
    descs = [writer.put(f"k{i}", [payload(500, i)]) for i in range(3)]
    descs.append(writer.hit("k0"))
    for d in descs:
        readers[0].ack(d)
    readers[1].ack(descs[1])
    with pytest.raises(SegmentFull):
        writer.put("big", [full_object(writer)])

    assert writer.reset_reader_slot(1) == 3
    assert writer.stats().unacked_refs == 0
    writer.check_invariants()
    writer.put("big", [full_object(writer)])
    with pytest.raises(ValueError):
        writer.reset_reader_slot(2)


def test_reset_reader_slot_keeps_what_is_still_to_be_sent(make_store: MakeStore) -> None:
    """A replacement reader will still receive the held refs: they stay outstanding, and
    a keep the slot has already acknowledged past is refused with nothing changed."""
    writer, readers = make_store(n_readers=2, capacity=4096)
    sent, held = writer.put("k", [payload(500)]), writer.hit("k")
    readers[0].ack(sent)
    assert writer.outstanding() == {sent.monotonic_id: (1, 2)}
    with pytest.raises(ValueError):
        writer.reset_reader_slot(0, keep={sent.monotonic_id: 2})
    assert writer.outstanding() == {sent.monotonic_id: (1, 2)}
    assert writer.reset_reader_slot(1, keep={sent.monotonic_id: 1}) == 1
    assert writer.outstanding() == {sent.monotonic_id: (1, 1)}
    for reader in readers:  # the replacement of slot 1 and slot 0 get the held reference
        reader.ack(held)
    assert writer.outstanding() == {} and writer.stats().unacked_refs == 0
    writer.check_invariants()


def test_outstanding_is_per_object_and_slot(make_store: MakeStore) -> None:
    writer, readers = make_store(n_readers=2, capacity=4096)
    a, b = writer.put("a", [payload(300)]), writer.put("b", [payload(300, 1)])
    b2 = writer.hit("b")
    readers[1].ack(b)
    assert writer.outstanding() == {a.monotonic_id: (1, 1), b.monotonic_id: (2, 1)}
    assert writer.stats().unacked_refs == 1 + 2  # the largest entry of each object
    for reader in readers:
        reader.ack(a)
    readers[0].ack(b)
    readers[0].ack(b2)
    readers[1].ack(b2)
    assert writer.outstanding() == {}


def test_reader_of_recreated_segment_gets_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "seg"
    crashed = ShmWriter(path, 4096, 1, 1024)  # never closed: a writer that died
    desc = crashed.put("x", [b"old"])
    old_reader = ShmReader(path, 0)
    with ShmWriter(path, 4096, 1, 1024) as writer:  # a restart replaces the stale file
        assert writer.generation != crashed.generation
        with pytest.raises(SegmentMismatch, match="re-created"):
            old_reader.get(desc)
        with ShmReader(path, 0) as reader:
            assert reader.generation == writer.generation
            with pytest.raises(StaleDescriptor, match="generation"):
                reader.get(desc)
        crashed.close()  # the old writer must not unlink its successor's file
        assert os.path.exists(path)
    old_reader.close()
    assert not os.path.exists(path)


def test_reader_of_closed_writer_gets_mismatch(tmp_path: Path) -> None:
    writer = ShmWriter(tmp_path / "seg", 4096, 1, 1024)
    desc = writer.put("x", [b"data"])
    reader = ShmReader(writer.path, 0)
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(SegmentMismatch, match="retired"):
        reader.get(desc)
    with pytest.raises(SegmentMismatch, match="no segment"):
        ShmReader(writer.path, 0)
    reader.close()
    assert os.listdir(tmp_path) == []


def test_attach_rejects_foreign_files_and_bad_slots(tmp_path: Path) -> None:
    with ShmWriter(tmp_path / "seg", 4096, 2, 1024) as writer:
        with pytest.raises(SegmentMismatch, match="2 reader slots"):
            ShmReader(writer.path, 2)
        image = bytearray(Path(writer.path).read_bytes())
    (tmp_path / "garbage").write_bytes(bytes(HEADER_SIZE + 4096))
    with pytest.raises(SegmentMismatch, match="bad magic"):
        ShmReader(tmp_path / "garbage", 0)
    (tmp_path / "short").write_bytes(b"tiny")
    with pytest.raises(SegmentMismatch, match="smaller than a segment header"):
        ShmReader(tmp_path / "short", 0)
    image[H_VERSION * 8] = 99
    (tmp_path / "future").write_bytes(image)
    with pytest.raises(SegmentMismatch, match="layout version 99"):
        ShmReader(tmp_path / "future", 0)


def test_reader_close_keeps_the_file_and_writer_unlinks(tmp_path: Path) -> None:
    with ShmWriter(tmp_path / "seg", 4096, 1, 1024) as writer:
        ShmReader(writer.path, 0).close()
        assert os.path.exists(writer.path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", [0o600, 0o640])
def test_segment_mode_ignores_umask(tmp_path: Path, mode: int) -> None:
    old = os.umask(0o077)
    try:
        with ShmWriter(tmp_path / "seg", 4096, 1, 1024, mode=mode) as writer:
            assert os.stat(writer.path).st_mode & 0o777 == mode
    finally:
        os.umask(old)


def test_stale_file_is_replaced(tmp_path: Path) -> None:
    (tmp_path / "seg").write_bytes(b"left by a crashed writer")
    with ShmWriter(tmp_path / "seg", 4096, 1, 1024) as writer, ShmReader(writer.path, 0) as r:
        assert r.get(writer.put("x", [b"fresh"])) == b"fresh"
        assert os.listdir(tmp_path) == ["seg"]


def test_segment_larger_than_filesystem_fails_at_creation() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    vfs = os.statvfs("/dev/shm")
    too_big = (vfs.f_blocks + 1024) * vfs.f_frsize  # beyond the size, let alone the free space
    before = set(os.listdir("/dev/shm"))
    path = f"/dev/shm/tandem-test-{os.getpid()}.seg"
    with pytest.raises(SegmentCreateError, match=f"cannot preallocate {too_big + HEADER_SIZE}"):
        ShmWriter(path, too_big, 1, 1024)
    assert set(os.listdir("/dev/shm")) <= before


def test_missing_directory_is_a_create_error(tmp_path: Path) -> None:
    with pytest.raises(SegmentCreateError, match="cannot create"):
        ShmWriter(tmp_path / "absent" / "seg", 4096, 1, 1024)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n_readers", [1, 2, 4])
def test_protocol_ends_balanced_with_readers_at_different_speeds(
        make_store: MakeStore, n_readers: int, seed: int) -> None:
    writer, readers = make_store(n_readers=n_readers, capacity=4096)
    x = payload(1000, seed)
    # one step: request A misses X (put) and request B hits it; request C has X twice;
    # request D hits X and is aborted before it is scheduled
    deliveries = sender_request(writer, ["X"], x) + sender_request(writer, ["X"], x)
    deliveries += sender_request(writer, ["X", "X"], x)
    for aborted in sender_request(writer, ["X"], x):
        writer.release(aborted)
    queues = [list(deliveries) for _ in readers]
    rng = random.Random(seed)
    speeds = [2.0**slot for slot in range(n_readers)]  # slot k is 2**k times faster than slot 0

    while any(queues):
        with pytest.raises(SegmentFull):  # no early reuse while any slot still owes an ack
            writer.put("filler", [full_object(writer)])
        weights = [speed * bool(q) for speed, q in zip(speeds, queues, strict=True)]
        slot = rng.choices(range(n_readers), weights)[0]
        desc, reader = queues[slot].pop(0), readers[slot]
        how = rng.choice(["get", "view", "ack"])
        if how == "get":
            assert reader.get(desc) == x
        elif how == "view":
            with reader.view(desc) as view:
                assert view == x
        else:
            reader.ack(desc)
        writer.check_invariants()

    assert writer.stats().unacked_refs == 0
    writer.put("filler", [full_object(writer)])
    assert not writer.is_cached("X")
    writer.check_invariants()


def test_release_after_reset_is_refused_and_changes_nothing(make_store: MakeStore) -> None:
    writer, readers = make_store(n_readers=2, capacity=1024)
    in_flight = writer.put("x", [payload(500)])
    writer.reset_reader_slot(1)  # slot 1 now counts `in_flight` as acknowledged
    before = Path(writer.path).read_bytes()
    with pytest.raises(StaleDescriptor, match="cannot release"):
        writer.release(in_flight)
    assert Path(writer.path).read_bytes() == before
    readers[0].ack(in_flight)  # delivered to the surviving reader instead: balanced
    assert writer.stats().unacked_refs == 0


def test_views_nest_and_acknowledge_on_exit_even_after_an_error(make_store: MakeStore) -> None:
    writer, (reader,) = make_store()
    a, b = writer.put("a", [b"first"]), writer.put("b", [b"second"])
    with reader.view(a) as view_a, reader.view(b) as view_b:  # no deadlock on the reader lock
        assert (bytes(view_a), bytes(view_b)) == (b"first", b"second")
        assert writer.stats().unacked_refs == 2
    assert writer.stats().unacked_refs == 0
    with pytest.raises(RuntimeError), reader.view(writer.hit("a")):
        raise RuntimeError("the consumer failed after reading")
    assert writer.stats().unacked_refs == 0
