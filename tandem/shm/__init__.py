"""Single-writer, multi-reader object store over a shared-memory file (bytes only).

See docs/shm.md for the segment layout, the reference-count protocol and the eviction policy.
"""

from tandem.shm.descriptor import ShmDescriptor
from tandem.shm.errors import (
    DuplicateKey,
    ObjectTooLarge,
    SegmentCreateError,
    SegmentFull,
    SegmentMismatch,
    ShmError,
    StaleDescriptor,
)
from tandem.shm.store import ShmReader, ShmStats, ShmWriter

__all__ = [
    "DuplicateKey",
    "ObjectTooLarge",
    "SegmentCreateError",
    "SegmentFull",
    "SegmentMismatch",
    "ShmDescriptor",
    "ShmError",
    "ShmReader",
    "ShmStats",
    "ShmWriter",
    "StaleDescriptor",
]
