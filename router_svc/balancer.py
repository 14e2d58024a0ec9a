"""Which cell serves a request: the key's ring order, minus cells that are down or full.

Bounded load follows "consistent hashing with bounded loads" (Mirrokni, Thorup and
Zadimoghaddam): with ``T`` requests in flight on the ``n`` serving cells, the new request
may go to a cell only if that cell's count after adding it stays within

    capacity = ceil(load_factor * (T + 1) / n)

so no cell ever holds more than ``load_factor`` times the mean, rounded up to a whole
request. Because ``n * capacity >= T + 1`` when ``load_factor >= 1``, some serving cell
always has room: a hot key spills along its ring order instead of melting one cell, and
cold keys keep their affinity. The rounding matters at low load: with one request in
flight on three cells the mean is 1/3, yet one cell must hold it.

Two more limits narrow the cells a request may go to (the endpoint picker uses both): a
subset named by the gateway (``only``), and a queue bound: a cell whose own count of
requests in flight (its last ``CacheStats``, all clients included) has reached
``queue_bound`` takes no more until it drains.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from router_svc.ring import DEFAULT_VNODES, HashRing

Reason = Literal["affinity", "spill", "failover"]
REASONS: tuple[Reason, ...] = ("affinity", "spill", "failover")


@dataclass(frozen=True)
class RouteDecision:
    """Where one request went and why.

    ``affinity``: the key's own cell; ``spill``: a later cell because an earlier serving
    one was at capacity (or over its queue bound); ``failover``: a later cell because the
    earlier ones were down (or had already failed this request, or were outside the
    request's subset).
    """

    cell: str
    reason: Reason

    def span_attributes(self) -> dict[str, str]:
        return {"tandem.route.cell": self.cell, "tandem.route.reason": self.reason}


class Balancer:
    """Routing state of one endpoint picker: cell health, requests in flight, decision counters.

    Invariants (checked whole by ``check_invariants``):

    * ``in_flight`` has an entry >= 0 for exactly the ring's cells;
    * ``healthy`` is a subset of the ring's cells;
    * ``peak_in_flight[c] >= in_flight[c]`` and ``peak_total >= `` the current total;
    * ``decisions`` counts every successful ``route`` call exactly once, keyed by
      ``(cell, reason)``;
    * ``queued`` (each cell's last reported requests in flight) has an entry >= 0 for
      exactly the ring's cells.

    Only this class mutates them: ``route`` acquires a slot on the chosen cell and
    ``release`` gives it back; ``set_healthy`` is the one way health changes, ``set_queued``
    the one way the reported queue does. The class is not thread-safe: the endpoint picker
    calls it from its event loop only.
    """

    def __init__(self, cells: Sequence[str], load_factor: float = 1.25,
                 vnodes: int = DEFAULT_VNODES, queue_bound: int = 0) -> None:
        if not load_factor >= 1.0:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        if queue_bound < 0:
            raise ValueError(f"queue_bound must be >= 0 (0 = none), got {queue_bound}")
        self.ring = HashRing(cells, vnodes)
        self.load_factor = load_factor
        self.queue_bound = queue_bound
        self.queued: dict[str, int] = dict.fromkeys(self.ring.cells, 0)
        self.healthy: set[str] = set()
        self.in_flight: dict[str, int] = dict.fromkeys(self.ring.cells, 0)
        self.peak_in_flight: dict[str, int] = dict.fromkeys(self.ring.cells, 0)
        self.peak_total = 0
        self.decisions: Counter[tuple[str, Reason]] = Counter()
        self.routed = 0

    @property
    def cells(self) -> tuple[str, ...]:
        return self.ring.cells

    def set_healthy(self, cell: str, healthy: bool) -> bool:
        """Marks a cell up or down; returns whether that changed anything."""
        if cell not in self.in_flight:
            raise KeyError(f"unknown cell {cell!r}")
        before = cell in self.healthy
        if healthy:
            self.healthy.add(cell)
        else:
            self.healthy.discard(cell)
        return before != healthy

    def set_queued(self, cell: str, requests: int) -> None:
        """A cell's own count of requests in flight, as it last reported it."""
        if cell not in self.queued:
            raise KeyError(f"unknown cell {cell!r}")
        self.queued[cell] = max(0, requests)

    def serving(self, exclude: Collection[str] = (),
                only: Collection[str] | None = None) -> list[str]:
        """The healthy cells a request may go to (``only``: among these), full or not."""
        return [c for c in self.ring.cells if c in self.healthy and c not in exclude
                and (only is None or c in only)]

    def queue_full(self, cell: str) -> bool:
        return 0 < self.queue_bound <= self.queued[cell]

    def capacity(self, exclude: Collection[str] = (),
                 only: Collection[str] | None = None) -> int:
        """The most requests any eligible cell may hold once one more is added."""
        serving = [c for c in self.serving(exclude, only) if not self.queue_full(c)]
        if not serving:
            return 0
        total = sum(self.in_flight[c] for c in serving)
        return math.ceil(self.load_factor * (total + 1) / len(serving))

    def route(self, key: bytes, exclude: Collection[str] = (),
              only: Collection[str] | None = None) -> RouteDecision | None:
        """Chooses a cell for ``key`` and takes a slot on it; None when no cell may take it
        (``serving`` tells "none is up" from "every one is over its queue bound").

        ``exclude`` names cells that already failed this request, so a retry goes on;
        ``only`` (None = every cell) is the subset the request must stay in.
        """
        cap = self.capacity(exclude, only)
        skipped_full = False
        for i, cell in enumerate(self.ring.walk(key)):
            if cell not in self.healthy or cell in exclude or (only is not None
                                                               and cell not in only):
                continue
            if self.queue_full(cell) or self.in_flight[cell] + 1 > cap:
                skipped_full = True
                continue
            reason: Reason = "affinity" if i == 0 else "spill" if skipped_full else "failover"
            self._acquire(cell)
            decision = RouteDecision(cell, reason)
            self.decisions[(cell, reason)] += 1
            self.routed += 1
            return decision
        return None

    def fallbacks(self, key: bytes, chosen: str,
                  only: Collection[str] | None = None) -> list[str]:
        """Where a request routed to ``chosen`` goes next if that cell fails before its
        first answer (the gateway retries there; no slot is taken): the other eligible
        cells (healthy, in ``only``, under their queue bound) in the key's ring order, as
        ``route`` would walk them with the failed cells excluded. The load bound is left
        out: it depends on which attempts fail, and a failover is rare and short."""
        return [c for c in self.ring.walk(key) if c != chosen and c in self.healthy
                and (only is None or c in only) and not self.queue_full(c)]

    def _acquire(self, cell: str) -> None:
        self.in_flight[cell] += 1
        self.peak_in_flight[cell] = max(self.peak_in_flight[cell], self.in_flight[cell])
        self.peak_total = max(self.peak_total, sum(self.in_flight.values()))

    def release(self, cell: str) -> None:
        """The request routed to ``cell`` ended (any way)."""
        assert self.in_flight[cell] > 0, f"release without route on {cell}"
        self.in_flight[cell] -= 1

    def decision_counts(self, reason: Reason) -> dict[str, int]:
        """Decisions with ``reason`` per cell (every cell present, zeros included)."""
        return {c: self.decisions[(c, reason)] for c in self.ring.cells}

    def check_invariants(self) -> None:
        self.ring.check_invariants()
        assert set(self.in_flight) == set(self.ring.cells) == set(self.queued)
        assert all(n >= 0 for n in self.queued.values()), self.queued
        assert all(n >= 0 for n in self.in_flight.values()), self.in_flight
        assert self.healthy <= set(self.ring.cells), self.healthy
        assert all(self.peak_in_flight[c] >= n for c, n in self.in_flight.items())
        assert self.peak_total >= sum(self.in_flight.values())
        assert sum(self.decisions.values()) == self.routed
        assert all(c in self.in_flight and r in REASONS for c, r in self.decisions)
