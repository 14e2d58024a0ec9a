"""A consistent-hash ring with virtual nodes: the cell a key prefers, then the next ones.

Each cell owns ``vnodes`` points on a 64-bit circle; a key belongs to the first point at or
after its own position. Removing a cell (or skipping it while it is down) moves only the
keys it owned, to the cells that follow it on the circle, and adding it back returns
exactly those keys. Virtual nodes spread each cell's share into many small arcs, so the
shares stay close to 1/n and a missing cell's keys spread over all the others rather
than landing on one neighbour.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterator, Sequence

DEFAULT_VNODES = 160


def position(data: bytes) -> int:
    """A point on the circle: the first 8 bytes of sha256, big-endian."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


class HashRing:
    """The circle of virtual nodes; immutable once built.

    Invariants: ``_positions`` is sorted and parallel to ``_owners``; every cell owns
    exactly ``vnodes`` points; cells are distinct. Health and load are not the ring's
    business: the balancer walks the ring and skips cells, so a cell's points never move.
    A ring of no cells (an endpoint picker whose pool has no ready pod) walks nowhere.
    """

    def __init__(self, cells: Sequence[str], vnodes: int = DEFAULT_VNODES) -> None:
        if len(set(cells)) != len(cells):
            raise ValueError(f"duplicate cells in {list(cells)}")
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        self.cells = tuple(cells)
        self.vnodes = vnodes
        # NOTE: ties (a 64-bit collision) are broken by the cell name, so the order stays
        # deterministic; no point is dropped, which keeps every cell at exactly vnodes.
        points = sorted((position(f"{cell}#{i}".encode()), cell)
                        for cell in cells for i in range(vnodes))
        self._positions = [p for p, _ in points]
        self._owners = [c for _, c in points]

    def walk(self, key: bytes) -> Iterator[str]:
        """Every cell once, in ring order from the key's position (its preference list)."""
        start = bisect.bisect_left(self._positions, position(key))
        seen: set[str] = set()
        n = len(self._owners)
        for i in range(n):
            cell = self._owners[(start + i) % n]
            if cell not in seen:
                seen.add(cell)
                yield cell
                if len(seen) == len(self.cells):
                    return

    def primary(self, key: bytes) -> str:
        """The cell that owns the key when every cell is up and none is full."""
        return next(self.walk(key))

    def check_invariants(self) -> None:
        assert len(self._positions) == len(self._owners) == self.vnodes * len(self.cells)
        assert all(a <= b for a, b in zip(self._positions, self._positions[1:], strict=False))
        for cell in self.cells:
            assert self._owners.count(cell) == self.vnodes, cell
