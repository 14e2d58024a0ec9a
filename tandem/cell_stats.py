"""CacheStats over many cells: the sum, and each cell's own figures beside it.

The public ``CacheStatsResponse`` describes one cell. The router answers with the sum over
the cells it reached (so dashboards and ``tandem stats`` keep working unchanged) and puts
every cell's own response in the trailing metadata, which ``tandem stats --per-cell``
reads back. This keeps the proto unchanged: one binary entry per reachable cell,
``tandem-cell-stats-bin`` = ``<target> \\n <serialized CacheStatsResponse>``, and one
``tandem-cell-unreachable`` = ``<target>`` per cell that did not answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from google.protobuf.descriptor import FieldDescriptor

from tandem.v1 import generate_pb2

STATS_KEY = "tandem-cell-stats-bin"
UNREACHABLE_KEY = "tandem-cell-unreachable"
MIXED = "mixed"

Stats = generate_pb2.CacheStatsResponse
Metadata = Sequence[tuple[str, str | bytes]]


def aggregate(stats: Sequence[Stats]) -> Stats:
    """Counters and sizes summed; ``mm_cache_type`` kept when all cells agree, else "mixed"."""
    total = Stats()
    for field in Stats.DESCRIPTOR.fields:
        values = [getattr(s, field.name) for s in stats]
        if field.type == FieldDescriptor.TYPE_STRING:
            kinds = set(values)
            setattr(total, field.name, kinds.pop() if len(kinds) == 1 else MIXED if kinds else "")
        else:
            setattr(total, field.name, sum(values))
    return total


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


def format_per_cell(total: Stats, cells: Mapping[str, Stats | None]) -> str:
    """A table: one row per field, the total then one column per cell ("-" = unreachable)."""
    header = ["field", "total", *cells]
    rows = [header]
    for field in Stats.DESCRIPTOR.fields:
        row = [field.name, str(getattr(total, field.name))]
        row += ["-" if s is None else str(getattr(s, field.name)) for s in cells.values()]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)
