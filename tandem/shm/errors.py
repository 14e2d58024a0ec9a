"""Typed errors of the SHM object store.

Callers branch on the type: `SegmentFull` and `ObjectTooLarge` mean "send the item inline
instead", `StaleDescriptor` means the descriptor does not name a live object of this segment
(a protocol bug or a forged value; nothing was changed), `SegmentMismatch` means the reader is
attached to a segment that is not (or no longer) the writer's current one and must re-attach.
"""


class ShmError(Exception):
    """Base class of every error raised by `tandem.shm`."""


class SegmentFull(ShmError):
    """No free or reclaimable space for this allocation right now; the store is unchanged."""


class ObjectTooLarge(ShmError):
    """The object exceeds the configured max object size or the segment capacity."""


class DuplicateKey(ShmError):
    """`put` of a key that is already stored; use `hit` for another reference."""


class StaleDescriptor(ShmError):
    """The descriptor does not name a live object, or its refs would over-acknowledge.

    Raised before any counter is written, so a stale or forged descriptor changes nothing.
    """


class SegmentMismatch(ShmError):
    """Bad magic or layout version, or the segment was re-created, retired or replaced."""


class SegmentCreateError(ShmError):
    """The segment file cannot be created or preallocated (e.g. ENOSPC on /dev/shm)."""
