"""Cache sizing from the cells' reuse curves, and the reference-ledger watch: pure functions.

Each cell's scheduler estimates, from the images it sees, the smallest processor cache
that reaches its target fraction of the achievable hit ratio (CacheStats
``mm_cache_recommended_bytes``, docs/cache-sizing.md). The operator bounds that by the room
on the cell's node (placement's cache budget), judges it against the cell's cache
(`judge`: Undersized / Oversized / Right, with hysteresis, and only after enough
references), folds the cells into the `CacheSized` condition and `status.cache`, and under
`featureCache.autoSize` picks the one cell to resize next (`next_resize`).

The watch: a cell whose segment references stay unacknowledged while it handles no
request is leaking them (every reference should be acknowledged once the steps that carry
it ran); `leak_verdict` turns one that stays so longer than the configured time into the
`ReferencesLeaking` condition.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tandem_operator.placement import Cell, format_bytes
from tandem_operator.spec import AutoSize

UNKNOWN, RIGHT, UNDERSIZED, OVERSIZED = "Unknown", "Right", "Undersized", "Oversized"
Verdict = tuple[str, str, str]  # (status "True"/"False"/"Unknown", reason, message)


@dataclass(frozen=True)
class SizingPolicy:
    """When a recommendation is acted on (TANDEM_OPERATOR_CACHE_* in docs/operator.md).

    Hysteresis: a cell turns Undersized once the recommendation exceeds its cache by more
    than `undersized_enter` and stays so until it falls to `undersized_exit`; likewise
    Oversized below `oversized_enter` until `oversized_exit`. So an estimate wandering
    around one threshold never flaps the condition, or a resize.
    """

    min_references: int = 1000  # a curve from fewer images is not evidence
    undersized_enter: float = 1.25
    undersized_exit: float = 1.10
    oversized_enter: float = 0.50
    oversized_exit: float = 0.60
    leak_seconds: float = 300.0  # unacknowledged while idle this long: ReferencesLeaking


@dataclass(frozen=True)
class Reading:
    """One cell's CacheStats, as much of it as sizing needs."""

    capacity_bytes: int
    recommended_bytes: int  # the scheduler's, unbounded
    references: int  # image references its curve saw (since the scheduler started)
    achievable: float  # hit ratio of an unbounded cache
    hit_ratio: float | None  # estimated at capacity_bytes (None: no such curve point)
    unacked_refs: int
    requests_in_flight: int


@dataclass
class CellCache:
    """What the operator knows of one cell's cache between timer passes (kept in memo).

    `verdict` is the last judgement (hysteresis needs it); `idle_since` the monotonic time
    from which every reading showed unacknowledged references and no request (None: the
    last one did not); `leak_reported` whether the Event of this episode was posted.
    """

    reading: Reading | None = None
    error: str = ""  # why there is no reading (unreachable...)
    verdict: str = UNKNOWN
    idle_since: float | None = None
    leak_reported: bool = False


@dataclass(frozen=True)
class Judged:
    """One cell's judgement: its cache, the bounded recommendation and the verdict."""

    index: int
    node: str
    current: int  # bytes the cell's cache has now
    recommended: int  # the scheduler's recommendation, bounded by `room`
    room: int  # the most its node could give it
    verdict: str
    reading: Reading | None
    error: str = ""
    target: int | None = field(default=None)  # under autoSize: the size to apply, if any


def judge(current: int, recommended: int, references: int, previous: str,
          policy: SizingPolicy) -> str:
    """The verdict on a cache of `current` bytes whose (bounded) recommendation is
    `recommended`, from a curve of `references`; `previous` gives the hysteresis."""
    if references < policy.min_references:
        return UNKNOWN
    above = policy.undersized_exit if previous == UNDERSIZED else policy.undersized_enter
    below = policy.oversized_exit if previous == OVERSIZED else policy.oversized_enter
    if recommended > current * above:
        return UNDERSIZED
    if recommended < current * below:
        return OVERSIZED
    return RIGHT


def judge_cells(cells: Sequence[Cell], rooms: Mapping[int, int],
                caches: Mapping[int, CellCache], policy: SizingPolicy,
                auto: AutoSize | None) -> list[Judged]:
    """Every placed cell judged (unplaced cells have no scheduler to ask)."""
    out = []
    for cell in cells:
        if not cell.node:
            continue
        cache = caches.get(cell.index) or CellCache()
        reading, room = cache.reading, rooms.get(cell.index, 0)
        if reading is None:
            out.append(Judged(cell.index, cell.node, cell.cache_bytes, 0, room, UNKNOWN, None,
                              cache.error or "no CacheStats read yet"))
            continue
        recommended = min(reading.recommended_bytes, room)
        verdict = judge(cell.cache_bytes, recommended, reading.references, cache.verdict,
                        policy)
        target = None
        if auto is not None and verdict in (UNDERSIZED, OVERSIZED):
            wanted = min(max(recommended, auto.min), auto.max)
            target = wanted if wanted != cell.requested_bytes else None
        out.append(Judged(cell.index, cell.node, cell.cache_bytes, recommended, room, verdict,
                          reading, target=target))
    return out


def next_resize(judged: Sequence[Judged], all_ready: bool) -> Judged | None:
    """The one cell autoSize resizes now: the lowest one with a target, and only while every
    cell is ready on its current config (so cells resize one at a time, as a roll does)."""
    if not all_ready:
        return None
    return next((j for j in judged if j.target is not None), None)


def _ratio(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"


def _cell_message(j: Judged, auto: AutoSize | None, policy: SizingPolicy) -> str:
    """One cell's sentence: what was observed and what a person (or autoSize) does."""
    r = j.reading
    where = f"cell {j.index} ({format_bytes(j.current)} cache on {j.node})"
    if r is None:
        return f"{where}: {j.error}"
    if j.verdict == UNKNOWN:
        return (f"{where}: its scheduler has seen {r.references} image references since it "
                f"started; sizing waits for {policy.min_references}")
    seen = (f"over {r.references} image references the estimated hit ratio is "
            f"{_ratio(r.hit_ratio)}, an unbounded cache would reach {_ratio(r.achievable)}, "
            f"and {format_bytes(j.recommended)} reaches the target fraction of that")
    bounded = (f" (it would take {format_bytes(r.recommended_bytes)}; the node has room for "
               f"{format_bytes(j.room)}: raise maxNodeMemoryPercent or use larger nodes)"
               if r.recommended_bytes > j.room else "")
    if j.verdict == RIGHT:
        return f"{where} is right-sized: {seen}{bounded}"
    if auto is not None:
        action = (f"autoSize ({format_bytes(auto.min)}..{format_bytes(auto.max)}) resizes it "
                  f"to {format_bytes(j.target)}" if j.target is not None
                  else f"autoSize keeps it at its bound {format_bytes(j.current)}")
    elif j.current == 0:  # no cache at all (type none): what one would give
        action = (f"turn the cache on: set spec.featureCache.type to shm and size to "
                  f"{format_bytes(j.recommended)}")
    else:
        action = (f"set spec.featureCache.size to {format_bytes(j.recommended)} (or set "
                  "featureCache.autoSize to let the operator size it)")
    return f"{where} is {j.verdict.lower()}: {seen}{bounded}; {action}"


def cache_sized_verdict(judged: Sequence[Judged], auto: AutoSize | None,
                        policy: SizingPolicy) -> Verdict:
    """`CacheSized`: False with the first problem's reason (Undersized before Oversized),
    True/Right when every cell is right, else Unknown (not enough evidence yet)."""
    if not judged:
        return "Unknown", "NoCells", "no placed cell to read CacheStats from"
    messages = "; ".join(_cell_message(j, auto, policy) for j in judged)
    verdicts = {j.verdict for j in judged}
    for problem in (UNDERSIZED, OVERSIZED):
        if problem in verdicts:
            return "False", problem, messages
    if verdicts == {RIGHT}:
        return "True", RIGHT, messages
    return "Unknown", "NotEnoughReferences" if all(j.reading for j in judged) else "NoStats", \
        messages


def observe_leak(cache: CellCache, now: float) -> None:
    """Update the idle-with-references clock from the cell's latest reading."""
    r = cache.reading
    if r is not None and r.unacked_refs > 0 and r.requests_in_flight == 0:
        if cache.idle_since is None:
            cache.idle_since = now
        return
    cache.idle_since = None
    cache.leak_reported = False


def leaking(cache: CellCache, now: float, policy: SizingPolicy) -> bool:
    return cache.idle_since is not None and now - cache.idle_since >= policy.leak_seconds


def leak_message(index: int, refs: int, seconds: float) -> str:
    """Stable while the leak lasts (no running clock), so status is not re-written."""
    return (f"cell {index}: {refs} segment references unacknowledged while the cell handled "
            f"no request for more than {seconds:.0f} s: the chunks they pin are never "
            "reclaimed; if it persists, delete the cell's worker pods (their successors' "
            "reader slots are reset) and report it with the scheduler's log")


def leaks(cells: Sequence[Cell], caches: Mapping[int, CellCache], now: float,
          policy: SizingPolicy) -> dict[int, str]:
    """Cell index -> message, for each placed cell leaking now."""
    out = {}
    for cell in cells:
        cache = caches.get(cell.index)
        if cell.node and cache is not None and cache.reading is not None \
                and cache.idle_since is not None and leaking(cache, now, policy):
            out[cell.index] = leak_message(cell.index, cache.reading.unacked_refs,
                                           policy.leak_seconds)
    return out


def leak_verdict(cells: Sequence[Cell], caches: Mapping[int, CellCache], now: float,
                 policy: SizingPolicy) -> Verdict:
    """`ReferencesLeaking`: True naming each leaking cell, else False (Unknown before any
    reading)."""
    placed = [c.index for c in cells if c.node]
    leaks_now = list(leaks(cells, caches, now, policy).values())
    if leaks_now:
        return "True", "UnacknowledgedWhileIdle", "; ".join(leaks_now)
    if not any(i in caches and caches[i].reading for i in placed):
        return "Unknown", "NoStats", "no CacheStats read yet"
    return "False", "NoLeak", ("no cell holds unacknowledged references for longer than "
                               f"{policy.leak_seconds:.0f} s while idle")


def status_cache(judged: Sequence[Judged]) -> dict[str, object]:
    """`status.cache`: each cell's figures and the largest bounded recommendation."""
    known = [j for j in judged if j.verdict != UNKNOWN]
    cells = []
    for j in judged:
        entry: dict[str, object] = {"index": j.index, "sizeBytes": j.current,
                                    "verdict": j.verdict}
        if j.reading is not None:
            r = j.reading
            entry |= {"recommendedBytes": j.recommended, "unboundedBytes": r.recommended_bytes,
                      "achievableHitRatio": round(r.achievable, 4),
                      "references": r.references, "unackedRefs": r.unacked_refs}
            if r.hit_ratio is not None:
                entry["hitRatio"] = round(r.hit_ratio, 4)
        else:
            entry["error"] = j.error
        cells.append(entry)
    return {"recommendedSize": quantity(max(j.recommended for j in known)) if known else "",
            "cells": cells}


def quantity(n: int) -> str:
    """A Kubernetes quantity of at least `n` bytes, to a tenth of its unit ("3.3Gi"): what a
    person pastes into featureCache.size."""
    for unit, size in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n >= size:
            return f"{math.ceil(n * 10 / size) / 10:g}{unit}"
    return str(n)
