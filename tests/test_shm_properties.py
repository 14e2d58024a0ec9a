"""Model-based check of the reference-count protocol: random put/hit/pin/unpin/deliver/
release/reset sequences over 1-4 reader slots.

Property: every chunk is reclaimed exactly when all its references are acknowledged. The
model keeps refs and per-slot acks; after every step the store must agree with it, no object
holding unacknowledged refs or a pin is ever evicted (its bytes still read back intact), a
duplicate acknowledgement is refused without changing the file, and once everything is
delivered and unpinned the whole segment can be reclaimed (no leak).
"""

import dataclasses
import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.shm import SegmentFull, ShmDescriptor, ShmReader, ShmWriter, StaleDescriptor
from tandem.shm.segment import chunk_header_size

CAPACITY = 1024
HOWS = ["get", "view", "ack"]


@dataclasses.dataclass
class ModelObject:
    desc: ShmDescriptor  # the put's descriptor: names the object for writer.read
    data: bytes
    refs: int
    acks: list[int]


class Model:
    """The expected state, plus the system under test it drives."""

    def __init__(self, directory: str, n_readers: int) -> None:
        self.writer = ShmWriter(Path(directory) / "seg", CAPACITY, n_readers, CAPACITY)
        self.readers = [ShmReader(self.writer.path, s) for s in range(n_readers)]
        self.objects: dict[str, ModelObject] = {}
        self.pins: Counter[str] = Counter()
        self.pending: list[list[ShmDescriptor]] = [[] for _ in range(n_readers)]
        self.undelivered: list[ShmDescriptor] = []  # issued, reached no slot: releasable
        self.gone: list[ShmDescriptor] = []  # descriptors of evicted objects
        self.keys_put = 0

    def key(self, pick: int) -> str:
        """A key put before (live or evicted), or the next key to be put."""
        return f"k{pick % (self.keys_put + 1)}"

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        self.writer.close()

    def reclaimable(self, key: str) -> bool:
        obj = self.objects[key]
        return not self.pins[key] and all(a == obj.refs for a in obj.acks)

    def key_of(self, desc: ShmDescriptor) -> str:
        return next(k for k, o in self.objects.items() if o.desc.monotonic_id == desc.monotonic_id)

    def issue(self, desc: ShmDescriptor) -> None:
        for queue in self.pending:
            queue.append(desc)
        self.undelivered.append(desc)

    # -- operations -------------------------------------------------------------------------

    def put(self, n: int, slot: int) -> None:
        key = f"k{self.keys_put}"
        data = bytes((n + slot + i) % 251 for i in range(n))
        evictable = {k for k in self.objects if self.reclaimable(k)}
        try:
            desc = self.writer.put(key, [data])
        except SegmentFull:
            assert evictable != set(self.objects), "full although everything is reclaimable"
            return
        for k in [k for k in self.objects if not self.writer.is_cached(k)]:
            assert k in evictable, f"{k} evicted with unacked refs or a pin"
            self.gone.append(self.objects.pop(k).desc)
        self.objects[key] = ModelObject(desc, data, 1, [0] * len(self.readers))
        self.keys_put += 1
        self.issue(desc)

    def hit(self, n: int, slot: int) -> None:
        key = self.key(n)
        if key in self.objects:
            self.objects[key].refs += 1
            self.issue(self.writer.hit(key))

    def pin(self, n: int, slot: int) -> None:
        key = self.key(n)
        self.writer.pin([key])
        self.pins[key] += 1

    def unpin(self, n: int, slot: int) -> None:
        key = self.key(n)
        if self.pins[key]:
            self.writer.unpin([key])
            self.pins[key] -= 1

    def deliver(self, n: int, slot: int) -> None:
        """Reader `slot` takes pending descriptor n (in any order: refs are fungible)."""
        queue = self.pending[slot]
        if not queue:
            return
        desc = queue.pop(n % len(queue))
        if desc in self.undelivered:
            self.undelivered.remove(desc)
        key = self.key_of(desc)
        reader, how = self.readers[slot], HOWS[n % len(HOWS)]
        if how == "get":
            assert reader.get(desc) == self.objects[key].data
        elif how == "view":
            with reader.view(desc) as view:
                assert view == self.objects[key].data
        else:
            reader.ack(desc)
        self.objects[key].acks[slot] += 1

    def catch_up(self, n: int, slot: int) -> None:
        """A slow reader processes its whole backlog."""
        while self.pending[slot]:
            self.deliver(n, slot)

    def release(self, n: int, slot: int) -> None:
        if not self.undelivered:
            return
        desc = self.undelivered.pop(n % len(self.undelivered))
        for queue in self.pending:
            queue.remove(desc)
        self.writer.release(desc)
        self.objects[self.key_of(desc)].refs -= 1

    def duplicate_ack(self, n: int, slot: int) -> None:
        """Acknowledge a descriptor whose refs this slot has all acknowledged: refused."""
        done = [o.desc for o in self.objects.values() if o.acks[slot] == o.refs]
        candidates = done + self.gone
        if not candidates:
            return
        before = Path(self.writer.path).read_bytes()
        try:
            self.readers[slot].ack(candidates[n % len(candidates)])
        except StaleDescriptor:
            pass
        else:
            raise AssertionError("duplicate acknowledgement accepted")
        assert Path(self.writer.path).read_bytes() == before

    def reset(self, n: int, slot: int) -> None:
        forgiven = sum(o.refs - o.acks[slot] for o in self.objects.values())
        assert self.writer.reset_reader_slot(slot) == forgiven
        for obj in self.objects.values():
            obj.acks[slot] = obj.refs
        self.pending[slot].clear()
        self.undelivered.clear()  # counted as acknowledged by `slot`: no longer releasable

    # -- checks -----------------------------------------------------------------------------

    def check(self) -> None:
        self.writer.check_invariants()
        stats = self.writer.stats()
        assert stats.objects == len(self.objects)
        assert stats.unacked_refs == sum(o.refs - min(o.acks) for o in self.objects.values())
        assert stats.pinned_objects == sum(1 for k in self.objects if self.pins[k])
        for key, obj in self.objects.items():
            assert self.writer.is_cached(key)
            assert self.writer.read(obj.desc) == obj.data

    def drain_and_check_no_leak(self) -> None:
        for slot in range(len(self.readers)):
            self.catch_up(2, slot)  # HOWS[2]: acknowledge only
        for key, n in list(self.pins.items()):
            self.writer.unpin([key] * n)
        self.pins.clear()
        assert self.writer.stats().unacked_refs == 0
        self.writer.put("everything", [bytes(CAPACITY - chunk_header_size(len(self.readers)))])
        self.writer.check_invariants()


# One op: (index into OPS, n: a size, a pick or a selector, reader slot before modulo).
# Weighted by repetition: puts and deliveries must be frequent enough to fill and wrap.
OPS = ["put"] * 3 + ["deliver"] * 3 + ["hit", "pin", "unpin", "catch_up", "release",
                                        "duplicate_ack", "reset"]
operation = st.tuples(st.integers(0, len(OPS) - 1), st.integers(0, 600), st.integers(0, 3))


@settings(max_examples=40, deadline=None)
@given(n_readers=st.integers(1, 4), ops=st.lists(operation, min_size=40, max_size=120))
def test_chunks_are_reclaimed_exactly_when_all_refs_are_acknowledged(
        n_readers: int, ops: list[tuple[int, int, int]]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        model = Model(directory, n_readers)
        try:
            for op, n, slot in ops:
                getattr(model, OPS[op])(n, slot % n_readers)
                model.check()
            model.drain_and_check_no_leak()
        finally:
            model.close()
