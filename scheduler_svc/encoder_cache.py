"""Scheduler-side bookkeeping of the workers' encoder-output cache.

The workers keep each encoded image's embeddings, keyed by mm hash, until the scheduler
tells them to drop it; this class decides what fits and what is dropped, so scheduler and
workers agree without asking each other. Sizes are counted in embeddings (the image's
placeholder tokens), not bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class EncoderCacheManager:
    """Which encoder outputs the workers hold, who uses them, and which may be evicted.

    An entry is *referenced* while some request still needs its embeddings (until its span
    is inside the request's computed KV), and *freeable* once no request does: it stays
    on the workers for reuse and is evicted oldest-freed first only when space is needed.
    Evicted hashes are reported once through :meth:`get_freed_mm_hashes`.

    Invariants (checked whole by :meth:`check_invariants`):

    * ``num_free_slots == capacity - sum of the sizes of all entries``, in [0, capacity];
    * an entry is in ``freeable`` exactly when no request references it, with its size;
    * ``num_freeable_slots == num_free_slots + sum(freeable sizes)``: what an allocation
      could get by evicting every freeable entry;
    * request -> hashes and hash -> requests are two views of the same references.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"encoder cache capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.num_free_slots = capacity
        self.num_freeable_slots = capacity
        self._size: dict[str, int] = {}  # mm_hash -> embeddings, for every entry
        self._refs: dict[str, set[str]] = {}  # mm_hash -> ids of requests using it
        self._by_request: dict[str, set[str]] = {}  # request id -> mm hashes it uses
        self._freeable: OrderedDict[str, int] = OrderedDict()  # zero-ref, oldest first
        self._freed: list[str] = []  # evicted since the last get_freed_mm_hashes()

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._size

    @property
    def mm_hashes(self) -> list[str]:
        """Every hash the workers hold (referenced or freeable)."""
        return list(self._size)

    def check_and_update_cache(self, request_id: str, mm_hash: str) -> bool:
        """True when the workers hold ``mm_hash``; the request then references it.

        A hit on a freeable entry revives it, so it cannot be evicted while used.
        """
        refs = self._refs.get(mm_hash)
        if refs is None:
            return False
        if not refs:
            self.num_freeable_slots -= self._freeable.pop(mm_hash)
        self._add_ref(request_id, mm_hash, refs)
        return True

    def can_allocate(self, num_embeds: int, budget: int, already_scheduled: int) -> bool:
        """Whether an item of ``num_embeds`` can be encoded this step; evicts to make room.

        ``budget`` is the encoder compute budget left in this step, ``already_scheduled``
        the embeddings of items this step has scheduled but not yet allocated. When room
        must be made, freeable entries are evicted oldest first, and the eviction stands
        even if the caller then fails to schedule the request (the entries were unused).
        """
        if num_embeds > budget:
            return False
        needed = num_embeds + already_scheduled
        if needed > self.num_freeable_slots:
            return False
        while needed > self.num_free_slots:
            mm_hash, size = self._freeable.popitem(last=False)
            del self._refs[mm_hash], self._size[mm_hash]
            self.num_free_slots += size
            self._freed.append(mm_hash)
        return True

    def allocate(self, request_id: str, mm_hash: str, num_embeds: int) -> None:
        """Reserves space for an item the workers will encode this step.

        Call after :meth:`can_allocate` said yes; a hash already held is a bug
        (:meth:`check_and_update_cache` would have returned True).
        """
        if mm_hash in self._size:
            raise ValueError(f"encoder output {mm_hash} allocated twice")
        if num_embeds > self.num_free_slots:
            raise ValueError(f"{num_embeds} embeddings do not fit in {self.num_free_slots} "
                             "free slots")
        self._size[mm_hash] = num_embeds
        self.num_free_slots -= num_embeds
        self.num_freeable_slots -= num_embeds
        refs: set[str] = set()
        self._refs[mm_hash] = refs
        self._add_ref(request_id, mm_hash, refs)

    def free_encoder_input(self, request_id: str, mm_hash: str) -> None:
        """Drops the request's reference once the item's span is in its computed KV.

        A no-op when the request holds no reference, so the scheduler may call it for
        every consumed item, including ones it never scheduled for the encoder.
        """
        refs = self._refs.get(mm_hash)
        if refs is None or request_id not in refs:
            return
        refs.remove(request_id)
        hashes = self._by_request[request_id]
        hashes.remove(mm_hash)
        if not hashes:
            del self._by_request[request_id]
        if not refs:
            size = self._size[mm_hash]
            self._freeable[mm_hash] = size
            self.num_freeable_slots += size

    def free(self, request_id: str) -> None:
        """Drops every reference of a finished, aborted or preempted request."""
        for mm_hash in sorted(self._by_request.get(request_id, ())):
            self.free_encoder_input(request_id, mm_hash)

    def forget(self, mm_hashes: Iterable[str]) -> None:
        """Drops entries the workers never computed (the step that allocated them was
        refused) once no request references them; nothing is reported to the workers."""
        for mm_hash in mm_hashes:
            if mm_hash in self._freeable:
                del self._freeable[mm_hash], self._refs[mm_hash]
                self.num_free_slots += self._size.pop(mm_hash)

    def get_freed_mm_hashes(self) -> list[str]:
        """Hashes evicted since the last call, each once; the list is then cleared.

        They go to the workers in the step message. A hash can be evicted and scheduled
        again in the same step, so workers drop these before running the step's encoder.
        """
        freed, self._freed = self._freed, []
        return freed

    def _add_ref(self, request_id: str, mm_hash: str, refs: set[str]) -> None:
        refs.add(request_id)
        self._by_request.setdefault(request_id, set()).add(mm_hash)

    def check_invariants(self) -> None:
        used = sum(self._size.values())
        assert self.num_free_slots == self.capacity - used, (
            f"free slots {self.num_free_slots} != capacity {self.capacity} - used {used}"
        )
        assert 0 <= self.num_free_slots <= self.capacity, f"free slots {self.num_free_slots}"
        assert self._refs.keys() == self._size.keys(), "entries without sizes or references"
        unreferenced = {h for h, refs in self._refs.items() if not refs}
        assert unreferenced == self._freeable.keys(), "freeable set != unreferenced entries"
        for mm_hash, size in self._freeable.items():
            assert size == self._size[mm_hash], f"freeable size of {mm_hash} is stale"
        freeable = sum(self._freeable.values())
        assert self.num_freeable_slots == self.num_free_slots + freeable, (
            f"freeable slots {self.num_freeable_slots} != free {self.num_free_slots} "
            f"+ freeable entries {freeable}"
        )
        pairs = {(r, h) for h, refs in self._refs.items() for r in refs}
        reverse = {(r, h) for r, hashes in self._by_request.items() for h in hashes}
        assert pairs == reverse, "request -> hash and hash -> request references disagree"
        assert all(self._by_request.values()), "a request entry with no references"
