"""Admission: the bound on what waits to run (docs/reliability.md, "Admission").

A request waits from its arrival until the scheduler runs it: first while its images are
checked and hashed (in the image threads) and acquired (processed, stored in the segment),
then in the scheduler's waiting queue, where a preempted request goes back too. Whatever
waits holds the client's images in memory and, once acquired, segment references that
keep its processed images from eviction; nothing else limits how much of it there is.

Two settings bound it: ``--max-waiting-requests`` and ``--max-waiting-image-bytes`` (the
client's image data of the waiting requests). The count is checked before anything of a
request is looked at, the bytes as soon as they are known (the images checked and hashed,
before any is acquired or processed); a request over either is refused with
RESOURCE_EXHAUSTED (HTTP 429 with ``Retry-After``) and leaves nothing held. A request whose
images alone exceed the byte bound is admitted when no other waiting request holds image
bytes, so every request the per-request limits allow can run.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

from scheduler_svc.request import Request
from tandem.errors import ResourceExhausted

REQUESTS, IMAGE_BYTES = "requests", "image_bytes"  # the limits, as the metric labels them
OVERLOADED = "OVERLOADED"


class Arrival:
    """One request on its way in, counted as waiting until it leaves ``Admission.arrival``."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.image_bytes = 0  # held against the byte bound (0 until :meth:`hold`)

    def hold(self, image_bytes: int) -> None:
        """Count the request's image bytes as waiting, or refuse it (ResourceExhausted)."""
        admission = self._admission
        _, held = admission.waiting()
        if held and held + image_bytes > admission.max_image_bytes:
            admission.rejected[IMAGE_BYTES] += 1
            raise ResourceExhausted(
                f"the server is overloaded: the requests waiting to run hold {held} bytes of "
                f"images and this one brings {image_bytes}, over the "
                f"{admission.max_image_bytes} it queues; retry later", OVERLOADED)
        self.image_bytes = image_bytes


class Admission:
    """Counts what waits and refuses what would exceed the bound.

    ``queued()`` is the scheduler's waiting queue (it is replaced when the engine resets);
    arriving requests are counted here until the caller queues them, which it must do
    before its next ``await`` so that nothing is ever counted twice or not at all.
    Runs on the event loop's thread only.
    """

    def __init__(self, max_requests: int, max_image_bytes: int,
                 queued: Callable[[], Collection[Request]]) -> None:
        self.max_requests = max_requests
        self.max_image_bytes = max_image_bytes
        self._queued = queued
        self._arriving: set[Arrival] = set()
        self.rejected = {REQUESTS: 0, IMAGE_BYTES: 0}  # since start, by the limit hit

    def waiting(self) -> tuple[int, int]:
        """(requests, image bytes) waiting now: arriving ones and the queue."""
        queued = self._queued()
        return (len(self._arriving) + len(queued),
                sum(a.image_bytes for a in self._arriving)
                + sum(r.image_bytes for r in queued))

    @contextmanager
    def arrival(self) -> Iterator[Arrival]:
        """A request arriving: refused (ResourceExhausted) when as many as the bound
        already wait; counted as waiting until the ``with`` block ends."""
        count = len(self._arriving) + len(self._queued())
        if count >= self.max_requests:
            self.rejected[REQUESTS] += 1
            raise ResourceExhausted(
                f"the server is overloaded: {count} requests are waiting to run, the most it "
                "queues; retry later", OVERLOADED)
        arrival = Arrival(self)
        self._arriving.add(arrival)
        try:
            yield arrival
        finally:
            self._arriving.discard(arrival)
