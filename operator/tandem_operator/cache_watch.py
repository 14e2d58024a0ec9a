"""The cache timer's steps: read every cell's CacheStats, judge its cache size and its
reference ledger (the pure part is cache_sizing.py), and under `featureCache.autoSize`
resize one cell.

A resize is the operator's own placement change, applied like a change of
`featureCache.size` but for one cell: the cell gets its new requested size, a new segment
generation and its children re-applied, so its pods roll; no other cell is resized until
every cell is ready on its current config again. The cell's scheduler restarts with an
empty curve, so nothing is decided about it again until it has seen enough images.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
import kopf

from tandem_operator.cache_sizing import (
    CellCache,
    SizingPolicy,
    cache_sized_verdict,
    judge_cells,
    leak_verdict,
    leaks,
    next_resize,
    observe_leak,
    status_cache,
)
from tandem_operator.cell_stats import CellUnreachable, cell_target, read_cell, tls_credentials
from tandem_operator.conditions import PodInfo
from tandem_operator.kube import KubeApi, Rejected
from tandem_operator.placement import Cell, NodeInfo, PodLoad, cache_room, format_bytes
from tandem_operator.reconcile import ServiceState, apply_cell, observe_cells, place
from tandem_operator.spec import TandemSpec


@dataclass(frozen=True)
class CachePass:
    """What one pass did, for the handler's Events."""

    resized: str  # the resize it applied ("" = none)
    new_leaks: list[str]  # cells that started leaking (one Event each)


async def _credentials(kube: KubeApi, spec: TandemSpec) -> grpc.ChannelCredentials | None:
    if not spec.tls.enabled:
        return None
    try:
        secret = await kube.read("Secret", spec.namespace, spec.tls.secret_name)
    except Rejected as e:
        raise CellUnreachable(str(e)) from e
    if secret is None:
        raise CellUnreachable(f"Secret {spec.tls.secret_name} (tls.secretName) not found")
    return tls_credentials(spec, secret)


def _scheduler_ip(pods: Sequence[PodInfo], index: int) -> str:
    return next((p.ip for p in pods if p.component == "scheduler" and p.cell == index
                 and p.ready and not p.deleting and p.ip), "")


async def read_caches(kube: KubeApi, spec: TandemSpec, state: ServiceState,
                      pods: Sequence[PodInfo], now: float) -> None:
    """Every placed cell's latest CacheStats into `state.caches` (or why there is none)."""
    placed = [c for c in state.cells if c.node]
    for index in list(state.caches):
        if index >= len(state.cells):
            del state.caches[index]  # scaled down
    try:
        credentials = await _credentials(kube, spec)
    except CellUnreachable as e:
        for cell in placed:
            cache = state.caches.setdefault(cell.index, CellCache())
            cache.reading, cache.error = None, str(e)
        return

    async def one(cell: Cell) -> None:
        cache = state.caches.setdefault(cell.index, CellCache())
        ip = _scheduler_ip(pods, cell.index)
        try:
            if not ip:
                raise CellUnreachable("its scheduler pod is not ready")
            cache.reading, cache.error = await read_cell(cell_target(spec, cell.index, ip),
                                                         credentials), ""
        except CellUnreachable as e:
            cache.reading, cache.error = None, str(e)
        observe_leak(cache, now)

    await asyncio.gather(*(one(c) for c in placed))


async def size_caches(kube: KubeApi, owner: kopf.Body, spec: TandemSpec, state: ServiceState,
                      nodes: Mapping[str, NodeInfo], loads: Sequence[PodLoad],
                      pods: Sequence[PodInfo], policy: SizingPolicy, now: float) -> CachePass:
    """Judge the cells from their readings, publish the verdicts into `state`, apply at most
    one autoSize resize and report the cells that started leaking."""
    rooms = {c.index: cache_room(spec, nodes, loads, state.cells, c.index)
             for c in state.cells if c.node}
    auto = spec.cache.auto_size
    judged = judge_cells(state.cells, rooms, state.caches, policy, auto)
    for j in judged:
        if j.verdict != "Unknown":
            state.caches[j.index].verdict = j.verdict
    state.sizing = {"CacheSized": cache_sized_verdict(judged, auto, policy),
                    "ReferencesLeaking": leak_verdict(state.cells, state.caches, now, policy)}
    state.cache_status = status_cache(judged)
    new_leaks = []
    for index, message in leaks(state.cells, state.caches, now, policy).items():
        if not state.caches[index].leak_reported:
            state.caches[index].leak_reported = True
            new_leaks.append(message)
    obs = observe_cells(spec, state.cells, pods)
    ready = all(obs.get(c.index) is not None and obs[c.index].ready for c in state.cells)
    chosen = next_resize(judged, ready)
    if chosen is None or chosen.target is None:
        return CachePass("", new_leaks)
    for cell in await place(state, spec, nodes, loads, resize={chosen.index: chosen.target}):
        await apply_cell(kube, owner, spec, state, cell)
    state.caches[chosen.index] = CellCache()  # its readings are of the old size
    r = chosen.reading
    refs = r.references if r is not None else 0
    return CachePass(
        f"cell {chosen.index}: autoSize resized its cache from {format_bytes(chosen.current)} "
        f"to {format_bytes(chosen.target)} ({chosen.verdict.lower()}: the smallest cache "
        f"reaching the target hit ratio over {refs} image references is "
        f"{format_bytes(chosen.recommended)}); the cell restarts on a fresh segment",
        new_leaks)
