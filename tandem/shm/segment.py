"""The segment file: header layout, chunk-header fields, atomic creation and attachment.

Every shared integer is an aligned native-endian u64 read and written through
`memoryview.cast("Q")`, so each store is one 8-byte write that no other process can observe
half-done. Each field has exactly one writer process (see the tables in docs/shm.md), which is
why the store needs no cross-process lock.
"""

import contextlib
import mmap
import os
import secrets
from dataclasses import dataclass, field

from tandem.shm.descriptor import ShmDescriptor
from tandem.shm.errors import SegmentCreateError, SegmentMismatch, StaleDescriptor

MAGIC = int.from_bytes(b"TNDMSEG\x00", "little")
LAYOUT_VERSION = 1
HEADER_SIZE = 4096
"""One page, so the data area (and every 64-byte aligned payload) starts page aligned."""
CHUNK_ALIGN = 64
MAX_READERS = 64
LIVE_TAG = int.from_bytes(b"TNDCHNK\x01", "little")
"""Chunk tag of a live object; free space and evicted chunks carry 0."""

# Segment header: u64 word index of each field.
H_MAGIC, H_VERSION, H_HEADER_SIZE, H_CAPACITY, H_N_READERS = 0, 1, 2, 3, 4
H_ACK_SLOTS, H_CHUNK_HEADER, H_CHUNK_ALIGN, H_MAX_OBJECT, H_GENERATION = 5, 6, 7, 8, 9
# H_ACK_SLOTS: ack counters per chunk header; layout 1 has exactly n_readers of them.

# Chunk header: u64 word index of each field, from the chunk start.
C_TAG, C_ID, C_NBYTES, C_SPAN, C_SEAL, C_REFS, C_ACKS = 0, 1, 2, 3, 4, 5, 6
"""C_ACKS is the first of `ack_slots` counters; ack[slot] is written only by reader `slot`."""

_MADV_POPULATE_READ = 22  # Linux >= 5.14; the mmap module of Python 3.11 lacks the names
_MADV_POPULATE_WRITE = 23
_MASK64 = (1 << 64) - 1


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def chunk_header_size(ack_slots: int) -> int:
    """Bytes before the payload: 6 fixed words plus one ack word per slot, cache-line padded."""
    return round_up((C_ACKS + ack_slots) * 8, CHUNK_ALIGN)


def chunk_seal(generation: int, address: int, monotonic_id: int, nbytes: int) -> int:
    """A 64-bit mix binding a chunk header to its generation, address, id and length.

    NOTE: the id check alone could be fooled when a stale descriptor's address now falls inside
    another object's payload whose bytes happen to look like a header with that id; the seal
    also needs the (random, never client-visible) generation, so payload bytes cannot pass.
    """
    x = (generation ^ address * 0x9E3779B97F4A7C15 ^ monotonic_id * 0xBF58476D1CE4E5B9
         ^ nbytes * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True, slots=True)
class Geometry:
    """The immutable shape of a segment, as recorded in its header."""

    capacity: int  # data-area bytes, a multiple of CHUNK_ALIGN
    n_readers: int
    max_object_size: int
    generation: int
    chunk_header_size: int = field(init=False)  # derived once: it is on every hot path

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunk_header_size", chunk_header_size(self.n_readers))


class Segment:
    """One mapped segment file: the header, the data area and typed access to chunk words.

    Layout: `[header, HEADER_SIZE bytes][data area, capacity bytes]`. The writer creates the
    file under a temporary name, preallocates it, writes the header and only then renames it
    over the final path, so a reader never sees a partial header. The generation word is the
    only header field that changes after creation: the writer sets it to 0 when it shuts down
    ("retired"), which every reader call checks.
    """

    def __init__(self, path: str, fd: int, geometry: Geometry) -> None:
        self.path = path
        self.geometry = geometry
        stat = os.fstat(fd)
        self._identity = (stat.st_dev, stat.st_ino)
        self._mmap = mmap.mmap(fd, HEADER_SIZE + geometry.capacity)
        self._bytes = memoryview(self._mmap)
        self._words = self._bytes.cast("Q")
        self._closed = False

    @classmethod
    def create(cls, path: str, geometry: Geometry, mode: int) -> "Segment":
        """Create, preallocate, prefault and publish a segment, replacing any stale file."""
        directory = os.path.dirname(os.path.abspath(path))
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
        total = HEADER_SIZE + geometry.capacity
        segment: Segment | None = None
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        except OSError as exc:
            raise SegmentCreateError(f"cannot create a segment file in {directory}: {exc}") from exc
        try:
            os.fchmod(fd, mode)  # the umask must neither widen nor narrow the requested mode
            _preallocate(fd, total, directory)
            segment = cls(path, fd, geometry)
            segment._prefault(_MADV_POPULATE_WRITE)
            segment._write_header()
            os.replace(tmp, path)
        except BaseException:
            if segment is not None:
                segment.close(unlink=False)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        return segment

    @classmethod
    def attach(cls, path: str) -> "Segment":
        """Map an existing segment after checking its header; SegmentMismatch if it is not one."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise SegmentMismatch(f"no segment at {path}: writer not started or shut down") from exc
        try:
            geometry = _read_geometry(fd, path)
            segment = cls(path, fd, geometry)
        finally:
            os.close(fd)
        segment._prefault(_MADV_POPULATE_READ)
        return segment

    def _write_header(self) -> None:
        g, w = self.geometry, self._words
        w[H_VERSION], w[H_HEADER_SIZE], w[H_CAPACITY] = LAYOUT_VERSION, HEADER_SIZE, g.capacity
        w[H_N_READERS], w[H_ACK_SLOTS] = g.n_readers, g.n_readers
        w[H_CHUNK_HEADER], w[H_CHUNK_ALIGN] = g.chunk_header_size, CHUNK_ALIGN
        w[H_MAX_OBJECT], w[H_GENERATION] = g.max_object_size, g.generation
        w[H_MAGIC] = MAGIC

    def _prefault(self, advice: int) -> None:
        """Map every page now, so the first puts and reads do not pay ~1.7 us per 4 KiB fault."""
        try:
            self._mmap.madvise(advice)
        except OSError:
            if advice == _MADV_POPULATE_WRITE:  # old kernel: touch the pages by hand
                step = 1 << 24
                for start in range(0, len(self._mmap), step):
                    end = min(start + step, len(self._mmap))
                    self._bytes[start:end] = bytes(end - start)

    # -- shared words -------------------------------------------------------------------------

    def word(self, address: int, field: int) -> int:
        """Chunk-header word `field` of the chunk at data-area offset `address`."""
        return self._words[((HEADER_SIZE + address) >> 3) + field]

    def set_word(self, address: int, field: int, value: int) -> None:
        self._words[((HEADER_SIZE + address) >> 3) + field] = value

    def payload(self, address: int, nbytes: int) -> memoryview:
        start = HEADER_SIZE + address + self.geometry.chunk_header_size
        return self._bytes[start : start + nbytes]

    def header_generation(self) -> int:
        return self._words[H_GENERATION]

    def retire(self) -> None:
        """Mark the segment dead for readers still mapping it (writer shutdown)."""
        self._words[H_GENERATION] = 0

    def is_current_file(self) -> bool:
        """Whether the file at `path` is still the one this process mapped."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (stat.st_dev, stat.st_ino) == self._identity

    def check_current(self) -> None:
        """SegmentMismatch unless this mapping is still the writer's live segment at `path`."""
        if self._closed:
            raise SegmentMismatch(f"segment {self.path} is closed in this process")
        if self.header_generation() != self.geometry.generation:
            raise SegmentMismatch(f"segment {self.path} was retired: its writer shut down")
        if not self.is_current_file():
            raise SegmentMismatch(
                f"segment {self.path} was removed or re-created by a new writer; re-attach")

    def check_descriptor(self, desc: ShmDescriptor) -> None:
        """StaleDescriptor unless `desc` names a live chunk of this segment; reads only."""
        g = self.geometry
        fields = (desc.generation, desc.address, desc.monotonic_id, desc.refs, desc.nbytes)
        if any(type(v) is not int for v in fields):
            raise StaleDescriptor(f"descriptor fields must be ints: {desc}")
        if desc.generation != g.generation:
            raise StaleDescriptor(
                f"descriptor of generation {desc.generation:#x}, segment is {g.generation:#x}")
        a = desc.address
        if a < 0 or a % CHUNK_ALIGN or a + g.chunk_header_size + max(desc.nbytes, 0) > g.capacity:
            raise StaleDescriptor(f"descriptor address/size out of range or misaligned: {desc}")
        if desc.refs < 1 or desc.nbytes < 0 or desc.monotonic_id < 1:
            raise StaleDescriptor(f"descriptor with invalid refs, nbytes or id: {desc}")
        if (self.word(a, C_TAG) != LIVE_TAG or self.word(a, C_ID) != desc.monotonic_id
                or self.word(a, C_NBYTES) != desc.nbytes
                or self.word(a, C_SEAL) != chunk_seal(g.generation, a, desc.monotonic_id,
                                                      desc.nbytes)):
            raise StaleDescriptor(f"no live object matches {desc}: evicted and reused, or forged")

    def close(self, unlink: bool) -> None:
        """Unmap and, for the writer, unlink the file unless a newer writer replaced it.

        Idempotent. Raises BufferError, leaving the mapping open, while a payload view (or a
        buffer made from one) is still alive; calling again after releasing it finishes.
        """
        if self._closed:
            return
        if unlink and self.is_current_file():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._words.release()
        self._bytes.release()
        self._mmap.close()
        self._closed = True


def _preallocate(fd: int, total: int, directory: str) -> None:
    """Reserve every byte now: tmpfs allocates lazily and a full one would SIGBUS a later write."""
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as exc:
        vfs = os.statvfs(directory)
        free = vfs.f_bavail * vfs.f_frsize
        raise SegmentCreateError(
            f"cannot preallocate {total} bytes for the segment in {directory} "
            f"({free} bytes free there): {exc.strerror}. Enlarge that filesystem (Kubernetes: "
            "an emptyDir with medium Memory and a sizeLimit at /dev/shm) or lower "
            "--mm-cache-size") from exc


def _read_geometry(fd: int, path: str) -> Geometry:
    size = os.fstat(fd).st_size
    if size < HEADER_SIZE:
        raise SegmentMismatch(f"{path} is {size} bytes, smaller than a segment header")
    with mmap.mmap(fd, HEADER_SIZE, prot=mmap.PROT_READ) as header:
        words = memoryview(header).cast("Q")
        try:
            values = words[: H_GENERATION + 1].tolist()
        finally:
            words.release()
    if values[H_MAGIC] != MAGIC:
        raise SegmentMismatch(f"{path} is not a tandem segment (bad magic)")
    if values[H_VERSION] != LAYOUT_VERSION:
        raise SegmentMismatch(
            f"{path} has layout version {values[H_VERSION]}, this reader knows {LAYOUT_VERSION}")
    n_readers, ack_slots = values[H_N_READERS], values[H_ACK_SLOTS]
    if (values[H_HEADER_SIZE] != HEADER_SIZE or values[H_CHUNK_ALIGN] != CHUNK_ALIGN
            or not 1 <= n_readers == ack_slots <= MAX_READERS
            or values[H_CHUNK_HEADER] != chunk_header_size(ack_slots)
            or size < HEADER_SIZE + values[H_CAPACITY]):
        raise SegmentMismatch(f"{path} has an inconsistent header: {values}")
    if values[H_GENERATION] == 0:
        raise SegmentMismatch(f"segment {path} was retired: its writer shut down")
    return Geometry(values[H_CAPACITY], n_readers, values[H_MAX_OBJECT], values[H_GENERATION])
