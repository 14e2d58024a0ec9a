"""CacheStats over many cells: the sum, and each cell's own figures beside it.

The public ``CacheStatsResponse`` describes one cell. In front of many cells the answer is
the sum over the cells reached (so dashboards and ``tandem stats`` keep working unchanged),
with every cell's own response in the trailing metadata, which ``tandem stats --per-cell``
reads back. This keeps the proto unchanged: one binary entry per reachable cell,
``tandem-cell-stats-bin`` = ``<target> \\n <serialized CacheStatsResponse>``, and one
``tandem-cell-unreachable`` = ``<target>`` per cell that did not answer.

Hit ratios do not add up: the sum weights each cell's by the image references its curve
saw (docs/cache-sizing.md). Each cell reports its curve at the same factors of its own
capacity (x0.25 .. x4), so point i of the sum is "every cell at factor i": its capacity
is the cells' capacities added, its hit ratio their ratios weighted by references.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from google.protobuf.descriptor import FieldDescriptor

from tandem.v1 import generate_pb2

STATS_KEY = "tandem-cell-stats-bin"
UNREACHABLE_KEY = "tandem-cell-unreachable"
# The cell that answered, in front of many cells: the gateway's response headers (gRPC
# initial metadata), GetModelInfo's trailing metadata.
CELL_HEADER = "x-tandem-cell"
MIXED = "mixed"

Stats = generate_pb2.CacheStatsResponse
Metadata = Sequence[tuple[str, str | bytes]]


CURVE = "mm_cache_curve"
WEIGHT = "mm_cache_curve_references"
RATIOS = frozenset({"mm_cache_achievable_hit_ratio"})  # weighted by WEIGHT, not summed


def aggregate(stats: Sequence[Stats]) -> Stats:
    """Counters and sizes summed; ``mm_cache_type`` kept when all cells agree, else "mixed";
    hit ratios and the curve weighted by each cell's references (the module docstring)."""
    total = Stats()
    weights = [getattr(s, WEIGHT) for s in stats]
    for field in Stats.DESCRIPTOR.fields:
        values = [getattr(s, field.name) for s in stats]
        if field.name == CURVE:
            getattr(total, CURVE).extend(_combined_curve(stats, weights))
        elif field.name in RATIOS:
            setattr(total, field.name, _weighted(values, weights))
        elif field.type == FieldDescriptor.TYPE_STRING:
            kinds = set(values)
            setattr(total, field.name, kinds.pop() if len(kinds) == 1 else MIXED if kinds else "")
        elif field.type in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_UINT32):
            setattr(total, field.name, sum(values))
        else:
            raise TypeError(f"CacheStatsResponse.{field.name}: no rule to combine cells")
    return total


def _weighted(values: Sequence[float], weights: Sequence[int]) -> float:
    total = sum(weights)
    return sum(v * w for v, w in zip(values, weights, strict=True)) / total if total else 0.0


def _combined_curve(stats: Sequence[Stats],
                    weights: Sequence[int]) -> list[generate_pb2.CurvePoint]:
    """Point i of every cell with a curve combined. A cell whose curve has another number of
    points (capacities so small that the factors collide) is left out of the curve."""
    curves = [(list(getattr(s, CURVE)), w) for s, w in zip(stats, weights, strict=True)
              if len(getattr(s, CURVE)) and w]
    if not curves:
        return []
    [(n, _)] = Counter(len(c) for c, _ in curves).most_common(1)
    curves = [(c, w) for c, w in curves if len(c) == n]
    return [generate_pb2.CurvePoint(
        capacity_bytes=sum(c[i].capacity_bytes for c, _ in curves),
        hit_ratio=_weighted([c[i].hit_ratio for c, _ in curves], [w for _, w in curves]))
        for i in range(n)]


def per_cell_metadata(results: Mapping[str, Stats | None]) -> Metadata:
    """Trailing metadata naming each cell's figures (None = the cell did not answer)."""
    out: list[tuple[str, str | bytes]] = []
    for cell, stats in results.items():
        if stats is None:
            out.append((UNREACHABLE_KEY, cell))
        else:
            out.append((STATS_KEY, cell.encode() + b"\n" + stats.SerializeToString()))
    return tuple(out)


def parse_per_cell(metadata: Metadata | None) -> dict[str, Stats | None]:
    """The inverse of ``per_cell_metadata``; empty when the server was a single cell."""
    out: dict[str, Stats | None] = {}
    for key, value in metadata or ():
        if key == STATS_KEY and isinstance(value, bytes):
            cell, _, raw = value.partition(b"\n")
            out[cell.decode()] = Stats.FromString(raw)
        elif key == UNREACHABLE_KEY:
            out[value.decode() if isinstance(value, bytes) else value] = None
    return out


def format_value(stats: Stats, name: str) -> str:
    """One field as a table cell: the curve as ``capacity:ratio`` pairs, ratios to 3 digits."""
    if name == CURVE:
        return ",".join(f"{p.capacity_bytes}:{p.hit_ratio:.3f}" for p in stats.mm_cache_curve)
    value = getattr(stats, name)
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def format_per_cell(total: Stats, cells: Mapping[str, Stats | None]) -> str:
    """A table: one row per field, the total then one column per cell ("-" = unreachable)."""
    header = ["field", "total", *cells]
    rows = [header]
    for field in Stats.DESCRIPTOR.fields:
        row = [field.name, format_value(total, field.name)]
        row += ["-" if s is None else format_value(s, field.name) for s in cells.values()]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)
