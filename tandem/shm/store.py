"""Single-writer, multi-reader object store over one segment file (bytes only).

The scheduler owns a `ShmWriter`; each worker process owns a `ShmReader` on its own ack slot.
They share nothing but the file: the writer hands out `ShmDescriptor`s (over gRPC), readers
copy the bytes out (or view them) and acknowledge in their own slot of the chunk header.
"""

import contextlib
import os
import secrets
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from tandem.shm.descriptor import ShmDescriptor
from tandem.shm.errors import (
    DuplicateKey,
    ObjectTooLarge,
    SegmentFull,
    SegmentMismatch,
    ShmError,
    StaleDescriptor,
)
from tandem.shm.segment import (
    C_ACKS,
    C_ID,
    C_NBYTES,
    C_REFS,
    C_SEAL,
    C_SPAN,
    C_TAG,
    CHUNK_ALIGN,
    LIVE_TAG,
    MAX_READERS,
    Geometry,
    Segment,
    chunk_seal,
    round_up,
)

Part = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class ShmStats:
    """A snapshot of the writer's bookkeeping (exported by the scheduler's CacheStats)."""

    capacity: int  # data-area bytes
    used_bytes: int  # bytes held by live chunks, headers and padding included
    objects: int  # live objects
    unacked_refs: int  # sum over objects of refs issued minus the slowest slot's acks
    pinned_objects: int  # live objects whose key has a pin
    evictions: int  # objects reclaimed to make room, since creation
    puts: int
    hits: int


@dataclass(slots=True)
class _Chunk:
    """Writer-local record of one chunk; `key is None` marks free space."""

    start: int
    span: int
    key: str | None = None
    monotonic_id: int = 0
    nbytes: int = 0


class ShmWriter:
    """The single writer: allocates, issues references, evicts and owns the segment file.

    Why: several worker processes in other pods must read the same multi-MB image tensors that
    the scheduler processed once, without a lock shared between pods and without head-of-line
    blocking or miscounting the references (the two failure modes of vLLM's store).

    Eviction policy (a clock-like ring): allocation scans chunks in address order from a cursor
    that sits after the last allocation, looking for a contiguous run of free or reclaimable
    chunks big enough for the object; a busy chunk (pinned, or not acknowledged by every slot)
    is skipped and the run restarts after it, and a run never wraps past the end of the data
    area. Only the chunks of the run that is finally used are evicted, oldest first since the
    cursor moves forward. `SegmentFull` is raised, with nothing evicted, only when a full lap
    finds no such run. So a pinned or unacknowledged chunk never blocks the space behind it.

    A chunk is reclaimable exactly when its key has no pin and every slot's ack equals the refs
    issued. References: `put` issues 1, `hit` 1 more, `release` takes back refs that will
    never reach the readers, and reader slot s adds `desc.refs` to ack[s] once per delivery.

    Invariants (checked whole by `check_invariants`):
    - the writer-local chunks tile the data area exactly: sorted, contiguous, 64-byte aligned;
    - the key index maps each key to exactly one live chunk, and every live chunk is indexed;
    - a live chunk's shared header (tag, id, nbytes, span, seal) matches the local record;
      free chunks carry no live tag; ids are unique and below the next id;
    - for every live chunk and every slot, ack[slot] <= refs issued;
    - every pin count is positive; the cursor is the start of a chunk.

    Only the writer mutates `_chunks`, `_index`, `_pins`, `_cursor` and, in shared memory, the
    header and each chunk's tag, id, nbytes, span, seal and refs; ack[s] belongs to reader s
    (the writer zeroes it when creating a chunk, and `reset_reader_slot` forgives a dead slot).
    Which references must reach which readers is the sender's business: the scheduler's
    delivery ledger (`scheduler_svc/delivery.py`) owns that, using `outstanding` to check it.
    Methods are meant for one thread, but take a lock anyway.
    """

    def __init__(self, path: str | os.PathLike[str], capacity: int, n_readers: int,
                 max_object_size: int, mode: int = 0o600) -> None:
        if not 1 <= n_readers <= MAX_READERS:
            raise ValueError(f"n_readers must be in 1..{MAX_READERS}, got {n_readers}")
        capacity -= capacity % CHUNK_ALIGN  # NOTE: rounded down rather than refused
        if capacity <= 0 or max_object_size < 0:
            raise ValueError(f"capacity {capacity} and max_object_size {max_object_size} invalid")
        generation = int.from_bytes(secrets.token_bytes(8), "little") or 1
        geometry = Geometry(capacity, n_readers, max_object_size, generation)
        self._segment = Segment.create(os.fspath(path), geometry, mode)
        self._geometry = geometry
        self._lock = threading.Lock()
        self._chunks: dict[int, _Chunk] = {0: _Chunk(0, capacity)}
        self._index: dict[str, int] = {}
        self._pins: dict[str, int] = {}
        self._cursor = 0
        self._next_id = 1
        self._evictions = self._puts = self._hits = 0
        self._closed = False

    @property
    def path(self) -> str:
        return self._segment.path

    @property
    def generation(self) -> int:
        return self._geometry.generation

    @property
    def capacity(self) -> int:
        """Data-area bytes (the requested capacity rounded down to 64)."""
        return self._geometry.capacity

    @property
    def n_readers(self) -> int:
        return self._geometry.n_readers

    @property
    def max_object_size(self) -> int:
        return self._geometry.max_object_size

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def is_cached(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def put(self, key: str, parts: Sequence[Part]) -> ShmDescriptor:
        """Store the parts back to back as one object and issue its first reference.

        Raises DuplicateKey, ObjectTooLarge or SegmentFull with the store unchanged.
        """
        views = [_byte_view(p) for p in parts]
        nbytes = sum(v.nbytes for v in views)
        with self._lock:
            self._check_open()
            if key in self._index:
                raise DuplicateKey(f"key {key!r} is already stored; take a hit instead")
            g = self._geometry
            span = round_up(g.chunk_header_size + nbytes, CHUNK_ALIGN)
            if nbytes > g.max_object_size or span > g.capacity:
                raise ObjectTooLarge(
                    f"object {key!r} is {nbytes} bytes; the max object size is "
                    f"{g.max_object_size} and the segment holds {g.capacity} bytes")
            run = self._find_run(span)
            if run is None:
                raise SegmentFull(f"no room for {span} bytes: every run of free or reclaimable "
                                  f"chunks is shorter ({len(self._index)} objects live)")
            chunk = self._claim(run, span, key, nbytes)
            with self._segment.payload(chunk.start, nbytes) as payload:
                offset = 0
                for view in views:
                    payload[offset : offset + view.nbytes] = view
                    offset += view.nbytes
            self._segment.set_word(chunk.start, C_REFS, 1)
            self._segment.set_word(chunk.start, C_TAG, LIVE_TAG)  # published last
            self._puts += 1
            return self._descriptor(chunk)

    def hit(self, key: str) -> ShmDescriptor:
        """Issue one more reference to a stored object (KeyError if absent)."""
        with self._lock:
            self._check_open()
            chunk = self._chunks[self._index[key]]
            refs = self._segment.word(chunk.start, C_REFS)
            self._segment.set_word(chunk.start, C_REFS, refs + 1)
            self._hits += 1
            return self._descriptor(chunk)

    def pin(self, keys: Iterable[str]) -> None:
        """Protect keys (present or not yet) from eviction; counts nest per occurrence."""
        with self._lock:
            for key in keys:
                self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, keys: Iterable[str]) -> None:
        """Drop one pin per occurrence; ValueError (and no change) for a pin never taken."""
        wanted = Counter(keys)
        with self._lock:
            missing = {k: n for k, n in wanted.items() if self._pins.get(k, 0) < n}
            if missing:
                raise ValueError(f"unpin of keys that are not pinned that often: {missing}")
            for key, n in wanted.items():
                left = self._pins[key] - n
                if left:
                    self._pins[key] = left
                else:
                    del self._pins[key]

    def release(self, desc: ShmDescriptor) -> None:
        """Take back references that will never reach the readers (aborted request).

        StaleDescriptor, with nothing changed, if the refs are not all outstanding in every
        slot (releasing them would make some slot's acks exceed the refs issued).
        """
        with self._lock:
            chunk = self._checked_chunk(desc)
            refs = self._segment.word(chunk.start, C_REFS)
            acked = max(self._acks(chunk))
            if refs - desc.refs < acked:
                raise StaleDescriptor(
                    f"cannot release {desc.refs} of {refs} refs: a slot already acked {acked}")
            self._segment.set_word(chunk.start, C_REFS, refs - desc.refs)

    def read(self, desc: ShmDescriptor) -> bytes:
        """Copy an object out on the writer side (to re-deliver it inline); acknowledges nothing."""
        with self._lock:
            chunk = self._checked_chunk(desc)
            with self._segment.payload(chunk.start, chunk.nbytes) as view:
                return bytes(view)

    def reset_reader_slot(self, slot: int, keep: Mapping[int, int] | None = None) -> int:
        """A reader died: count its outstanding refs as acknowledged; returns how many.

        Call only once that reader process is known gone: this writes its ack slot, which a
        live reader may be updating at the same moment (a lost update either way). `keep`
        (monotonic id -> refs) leaves that many refs of an object outstanding: references
        issued but not yet sent, which the replacement reader will still receive and ack.
        ValueError, with nothing changed, if the slot already acked some of them.
        Give the replacement reader new references (`hit`), never the old descriptors.
        """
        if not 0 <= slot < self._geometry.n_readers:
            raise ValueError(f"slot {slot} out of range 0..{self._geometry.n_readers - 1}")
        keep = keep or {}
        forgiven = 0
        with self._lock:
            self._check_open()
            targets = []
            for chunk in self._live_chunks():
                refs = self._segment.word(chunk.start, C_REFS)
                target = refs - keep.get(chunk.monotonic_id, 0)
                acked = self._segment.word(chunk.start, C_ACKS + slot)
                if target < acked:
                    raise ValueError(f"slot {slot} already acked {acked} of {refs} refs of "
                                     f"object {chunk.monotonic_id}; cannot keep "
                                     f"{refs - target} outstanding")
                targets.append((chunk.start, target))
                forgiven += target - acked
            for start, target in targets:
                self._segment.set_word(start, C_ACKS + slot, target)
        return forgiven

    def outstanding(self) -> dict[int, tuple[int, ...]]:
        """Per live object with any: monotonic id -> refs issued minus each slot's acks.

        For the sender's own accounting of what it has issued (`stats().unacked_refs` is the
        sum over objects of the largest entry). A slot's entry may still fall while a
        reader works; read it when no delivery to that reader is in progress.
        """
        with self._lock:
            self._check_open()
            out = {}
            for chunk in self._live_chunks():
                refs = self._segment.word(chunk.start, C_REFS)
                left = tuple(refs - ack for ack in self._acks(chunk))
                if any(left):
                    out[chunk.monotonic_id] = left
            return out

    def stats(self) -> ShmStats:
        with self._lock:
            self._check_open()
            live = list(self._live_chunks())
            unacked = sum(self._segment.word(c.start, C_REFS) - min(self._acks(c)) for c in live)
            return ShmStats(
                capacity=self._geometry.capacity,
                used_bytes=sum(c.span for c in live),
                objects=len(live),
                unacked_refs=unacked,
                pinned_objects=sum(1 for c in live if c.key in self._pins),
                evictions=self._evictions,
                puts=self._puts,
                hits=self._hits,
            )

    def check_invariants(self) -> None:
        with self._lock:
            self._check_open()
            self._check_tiling()
            self._check_live_chunks()
            assert all(n > 0 for n in self._pins.values()), self._pins
            assert self._cursor in self._chunks, (self._cursor, sorted(self._chunks))

    def close(self) -> None:
        """Retire the segment for its readers, unmap and unlink it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._segment.retire()
            self._segment.close(unlink=True)

    # -- allocation ---------------------------------------------------------------------------

    def _find_run(self, span: int) -> list[_Chunk] | None:
        """First run (from the cursor, at most one lap of run starts) of >= span evictable bytes."""
        run: list[_Chunk] = []
        run_bytes = 0
        for chunk in self._walk(self._cursor, 2 * len(self._chunks)):
            if chunk.start == 0:
                run, run_bytes = [], 0  # a run never wraps past the end of the data area
            if not self._evictable(chunk):
                run, run_bytes = [], 0
                continue
            run.append(chunk)
            run_bytes += chunk.span
            if run_bytes >= span:
                return run
        return None

    def _walk(self, start: int, steps: int) -> Iterator[_Chunk]:
        capacity = self._geometry.capacity
        for _ in range(steps):
            chunk = self._chunks[start]
            yield chunk
            start = (chunk.start + chunk.span) % capacity

    def _evictable(self, chunk: _Chunk) -> bool:
        if chunk.key is None:
            return True
        if chunk.key in self._pins:
            return False
        refs = self._segment.word(chunk.start, C_REFS)
        return all(ack == refs for ack in self._acks(chunk))

    def _claim(self, run: list[_Chunk], span: int, key: str, nbytes: int) -> _Chunk:
        """Evict the run, carve a live chunk from its front and leave the rest free."""
        seg = self._segment
        start, end = run[0].start, run[-1].start + run[-1].span
        for old in run:
            del self._chunks[old.start]
            if old.key is not None:
                del self._index[old.key]
                seg.set_word(old.start, C_TAG, 0)  # stale descriptors now fail validation
                self._evictions += 1
        chunk = _Chunk(start, span, key, self._next_id, nbytes)
        self._next_id += 1
        self._chunks[start] = chunk
        self._index[key] = start
        if end > start + span:
            self._chunks[start + span] = _Chunk(start + span, end - start - span)
            seg.set_word(start + span, C_TAG, 0)
        self._cursor = (start + span) % self._geometry.capacity
        seal = chunk_seal(self._geometry.generation, start, chunk.monotonic_id, nbytes)
        for field, value in ((C_ID, chunk.monotonic_id), (C_NBYTES, nbytes), (C_SPAN, span),
                             (C_SEAL, seal), (C_REFS, 0)):
            seg.set_word(start, field, value)
        for slot in range(self._geometry.n_readers):
            seg.set_word(start, C_ACKS + slot, 0)
        return chunk

    # -- helpers ------------------------------------------------------------------------------

    def _descriptor(self, chunk: _Chunk) -> ShmDescriptor:
        return ShmDescriptor(self._geometry.generation, chunk.start, chunk.monotonic_id, 1,
                             chunk.nbytes)

    def _checked_chunk(self, desc: ShmDescriptor) -> _Chunk:
        self._check_open()
        self._segment.check_descriptor(desc)
        chunk = self._chunks.get(desc.address)
        if chunk is None or chunk.key is None or chunk.monotonic_id != desc.monotonic_id:
            raise StaleDescriptor(f"no live object matches {desc}")
        return chunk

    def _acks(self, chunk: _Chunk) -> list[int]:
        return [self._segment.word(chunk.start, C_ACKS + s)
                for s in range(self._geometry.n_readers)]

    def _live_chunks(self) -> Iterator[_Chunk]:
        return (c for c in self._chunks.values() if c.key is not None)

    def _check_open(self) -> None:
        if self._closed:
            raise ShmError(f"writer of {self._segment.path} is closed")

    def _check_tiling(self) -> None:
        position = 0
        for start in sorted(self._chunks):
            chunk = self._chunks[start]
            assert chunk.start == start == position, (start, position)
            assert chunk.span > 0 and chunk.span % CHUNK_ALIGN == 0, chunk
            position += chunk.span
        assert position == self._geometry.capacity, (position, self._geometry.capacity)

    def _check_live_chunks(self) -> None:
        seg, g = self._segment, self._geometry
        live = list(self._live_chunks())
        assert {c.key: c.start for c in live} == self._index, "key index != live chunks"
        assert len({c.monotonic_id for c in live}) == len(live), "duplicate monotonic ids"
        for chunk in self._chunks.values():
            if chunk.key is None:
                assert seg.word(chunk.start, C_TAG) != LIVE_TAG, chunk
                continue
            assert 0 < chunk.monotonic_id < self._next_id, chunk
            expected = (LIVE_TAG, chunk.monotonic_id, chunk.nbytes, chunk.span,
                        chunk_seal(g.generation, chunk.start, chunk.monotonic_id, chunk.nbytes))
            shared = tuple(seg.word(chunk.start, f) for f in (C_TAG, C_ID, C_NBYTES, C_SPAN,
                                                              C_SEAL))
            assert shared == expected, (chunk, shared)
            assert g.chunk_header_size + chunk.nbytes <= chunk.span, chunk
            refs = seg.word(chunk.start, C_REFS)
            assert all(ack <= refs for ack in self._acks(chunk)), (chunk, refs, self._acks(chunk))


class ShmReader:
    """One reader slot of a segment (a worker process): validates, copies out, acknowledges.

    Every call first checks that the mapping is still the writer's live segment (retired,
    removed or re-created raise SegmentMismatch) and that the descriptor names a live chunk
    with at least `desc.refs` references outstanding for this slot (else StaleDescriptor);
    both checks happen before any write, so a bad descriptor changes no counter. The ack is
    written only after the bytes were copied out (or the view released), so the writer can
    never reclaim a chunk under an active read. Only this reader writes ack[slot].
    """

    def __init__(self, path: str | os.PathLike[str], slot: int) -> None:
        self._segment = Segment.attach(os.fspath(path))
        n = self._segment.geometry.n_readers
        if not 0 <= slot < n:
            self._segment.close(unlink=False)
            raise SegmentMismatch(f"segment {path} has {n} reader slots, not slot {slot}")
        self.slot = slot
        self._lock = threading.Lock()

    @property
    def generation(self) -> int:
        return self._segment.geometry.generation

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def get(self, desc: ShmDescriptor) -> bytes:
        """Validate, copy the object out, then acknowledge `desc.refs` in this slot."""
        with self._validated(desc) as view:
            data = bytes(view)
        self._ack(desc)
        return data

    @contextlib.contextmanager
    def view(self, desc: ShmDescriptor) -> Iterator[memoryview]:
        """Validate and yield a zero-copy view; acknowledge on exit, after the view is released.

        Nothing made from the view may outlive the block: after the ack the writer may reuse
        the bytes, and slices, numpy arrays or torch tensors made from the view keep pointing
        at them (they hold the mapping, not an export the store could check). Copy out inside
        the block, e.g. `torch.frombuffer(view, dtype=...).clone()`.
        """
        view = self._validated(desc)
        try:
            yield view
        finally:
            view.release()
            self._ack(desc)

    @contextlib.contextmanager
    def peek(self, desc: ShmDescriptor, pending: int = 0) -> Iterator[memoryview]:
        """Validate and yield a zero-copy view without acknowledging; the caller acks later.

        Why: a worker checks a whole step before it changes anything, so it reads every
        descriptor first and acknowledges them only once the step is accepted. `pending` is
        the refs this slot will acknowledge for the same chunk from earlier peeks of that
        step; they count as acknowledged, so a descriptor repeated within one step cannot
        pass twice. The chunk cannot be reclaimed meanwhile: this slot has not acked it.
        """
        view = self._validated(desc, pending)
        try:
            yield view
        finally:
            view.release()

    def ack(self, desc: ShmDescriptor) -> None:
        """Validate and acknowledge without reading the payload."""
        self._validated(desc).release()
        self._ack(desc)

    def close(self) -> None:
        self._segment.close(unlink=False)

    def _validated(self, desc: ShmDescriptor, pending: int = 0) -> memoryview:
        with self._lock:
            self._segment.check_current()
            self._segment.check_descriptor(desc)
            self._check_outstanding(desc, pending)
            return self._segment.payload(desc.address, desc.nbytes)

    def _ack(self, desc: ShmDescriptor) -> None:
        """Add desc.refs to this slot's counter: one 8-byte store, after a re-check.

        NOTE: the lock is not held while the caller reads the payload (no deadlock when views
        nest); the re-check under the lock makes a descriptor delivered twice to two threads
        of this reader fail on its second ack instead of over-acknowledging.
        """
        with self._lock:
            acked = self._check_outstanding(desc)
            self._segment.set_word(desc.address, C_ACKS + self.slot, acked + desc.refs)

    def _check_outstanding(self, desc: ShmDescriptor, pending: int = 0) -> int:
        """This slot's acks so far; StaleDescriptor if desc.refs are not all outstanding
        beyond `pending` refs about to be acknowledged."""
        refs = self._segment.word(desc.address, C_REFS)
        acked = self._segment.word(desc.address, C_ACKS + self.slot)
        if acked + pending + desc.refs > refs:
            raise StaleDescriptor(f"slot {self.slot} already acked {acked} of {refs} refs; "
                                  f"{desc} would over-acknowledge")
        return acked


def _byte_view(part: Part) -> memoryview:
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
