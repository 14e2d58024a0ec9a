"""What the sender does for one request, for the store tests: pin every key, then hit or put
each occurrence (so a request's own puts cannot evict its hits)."""

from __future__ import annotations

from tandem.shm import ShmDescriptor, ShmWriter


def sender_request(writer: ShmWriter, keys: list[str], data: bytes) -> list[ShmDescriptor]:
    writer.pin(keys)
    try:
        return [writer.hit(k) if writer.is_cached(k) else writer.put(k, [data]) for k in keys]
    finally:
        writer.unpin(keys)
