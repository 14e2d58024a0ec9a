"""The operator's steps, called by the thin kopf handlers in handlers.py.

Each step is idempotent (apply = create or merge-patch to the built state), so kopf may retry
any of them; decisions come from the pure placement/conditions functions, API calls from
KubeApi, and everything kopf-specific (errors, events, adoption) stays visible here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kopf

from tandem_operator.cache_sizing import CellCache, Verdict
from tandem_operator.conditions import (
    CellObservation,
    PodInfo,
    cell_status,
    fold_verdicts,
    observe_cell,
    render_conditions,
)
from tandem_operator.front import LEGACY_ROUTER_SUFFIX, front_available
from tandem_operator.gateway import (
    GRPC_POOL,
    HTTP_POOL,
    build_envoy_configmap,
    build_envoy_deployment,
    build_epp_configmap,
    build_epp_deployment,
    build_epp_role,
    build_epp_role_binding,
    build_epp_service,
    build_epp_service_account,
    build_inference_pool,
    envoy_name,
    epp_name,
    pool_name,
    pools,
)
from tandem_operator.kube import KubeApi, Rejected
from tandem_operator.manifests import (
    CELL_LABEL,
    COMPONENT_LABEL,
    GENERATION,
    NODE,
    build_cleanup_job,
    build_configmap,
    build_service,
    build_workers_service,
    cell_config,
    cell_dir,
    child_name,
    config_hash,
    endpoint,
    scale_selector,
)
from tandem_operator.placement import INSTANCE_LABEL, Cell, NodeInfo, PodLoad, place_cells
from tandem_operator.spec import TandemSpec
from tandem_operator.workloads import build_pod_template, build_statefulset

# The Deployment of each component a Service may front the cells with (TandemSpec.front).
FRONT_NAMES: dict[str, Callable[[TandemSpec], str]] = {"envoy": envoy_name}


@dataclass(frozen=True)
class Front:
    """What clients reach: the component the Service points at (TandemSpec.front), and the
    cells the endpoint picker lists (none without it)."""

    target: str
    cells: tuple[int, ...]

    @classmethod
    def wanted(cls, spec: TandemSpec, cells: Sequence[Cell]) -> Front:
        listed = tuple(c.index for c in cells) if spec.picked else ()
        return cls(spec.front, listed)


@dataclass
class ServiceState:
    """The operator's record of one TandemService, kept in kopf's per-object memo.

    Why: kopf runs timers beside change handlers, and the `status` a handler receives is a
    snapshot, so placement needs one current value with one writer at a time; it lives here,
    seeded from `status.cells` after an operator restart, and `status` is its published copy.
    Invariants: `cells[i].index == i` and each Cell's own invariants hold; `rejected` holds
    only indexes of cells. `cells` and `front` are replaced only under `lock`. The cache
    timer (cache_watch.py) alone writes `caches`, `sizing` and `cache_status`; status
    publishes them.
    """

    cells: list[Cell]
    rejected: dict[int, str] = field(default_factory=dict)  # cell -> Pod Security message
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    front: Front | None = None  # what apply_front last applied; None: not yet (or restarted)
    caches: dict[int, CellCache] = field(default_factory=dict)  # cell -> what its stats say
    sizing: dict[str, Verdict] = field(default_factory=lambda: {
        kind: ("Unknown", "NoStats", "the cells' CacheStats were not read yet")
        for kind in ("CacheSized", "ReferencesLeaking")})
    cache_status: dict[str, Any] = field(default_factory=dict)  # status.cache

    def check_invariants(self) -> None:
        for i, cell in enumerate(self.cells):
            assert cell.index == i, (i, cell)
            cell.check_invariants()
        assert all(0 <= i < len(self.cells) for i in self.rejected), self.rejected


def cells_from_status(status: Mapping[str, Any]) -> list[Cell]:
    """The placement recorded in `status.cells` (what a restarted operator starts from)."""
    return [Cell(index=c["index"], node=c.get("nodeName", ""),
                 cache_bytes=c.get("segmentBytes", 0), requested_bytes=c.get("requestedBytes", 0),
                 generation=c.get("segmentGeneration", 0),
                 reason="" if c.get("nodeName") else "not placed yet")
            for c in sorted(status.get("cells") or (), key=lambda c: c["index"])]


def service_state(memo: kopf.Memo, status: Mapping[str, Any]) -> ServiceState:
    state = memo.get("tandem_state")
    if state is None:
        state = memo["tandem_state"] = ServiceState(cells_from_status(status))
    assert isinstance(state, ServiceState)
    return state


def nodes_of(index: kopf.Index[str, NodeInfo]) -> dict[str, NodeInfo]:
    return {name: node for name, store in index.items() for node in store}


def loads_of(index: kopf.Index[str, PodLoad]) -> list[PodLoad]:
    return [load for store in index.values() for load in store]


def retry_delay(retry: int) -> float:
    """Exponential backoff for "not yet" (no fitting node, admission): 5 s doubling to 5 min."""
    return float(min(300, 5 * 2 ** min(retry, 6)))


def wait_delay(retry: int) -> float:
    """Backoff while waiting for what the operator started (a cell rolling before the next
    one, cleanup Jobs): 2 s three times, then doubling to 30 s. Each retry posts an Event, so
    a long model load posts a few dozen, not one every 2 s; short waits stay short, and a
    wait ends at most 30 s after its cause."""
    return float(min(30, 2 * 2 ** min(max(retry - 2, 0), 4)))


async def place(state: ServiceState, spec: TandemSpec, nodes: Mapping[str, NodeInfo],
                loads: Iterable[PodLoad], force: frozenset[int] = frozenset(),
                resize: Mapping[int, int] | None = None) -> list[Cell]:
    """Re-run placement under the state's lock; return the cells whose node or generation
    changed (each then needs its children applied). `resize`: see `place_cells`."""
    async with state.lock:
        before = {c.index: c for c in state.cells}
        state.cells = place_cells(spec, nodes, loads, state.cells, force, resize)
        state.rejected = {i: m for i, m in state.rejected.items() if i < len(state.cells)}
        return [c for c in state.cells if c.index not in before
                or (c.node, c.generation) != (before[c.index].node, before[c.index].generation)]


def observe_cells(spec: TandemSpec, cells: Sequence[Cell],
                  pods: Sequence[PodInfo]) -> dict[int, CellObservation]:
    return {c.index: observe_cell(spec, c, config_hash(cell_config(spec, c)), pods)
            for c in cells if c.node}


def roll_blocker(spec: TandemSpec, cells: Sequence[Cell], index: int,
                 pods: Sequence[PodInfo]) -> str:
    """Why cell `index` must wait before its new config is applied, or "".

    Cells roll one at a time: a cell whose pods run an older config waits until every lower
    cell is ready on its current one. A cell without pods (first start) never waits.
    """
    current = config_hash(cell_config(spec, cells[index]))
    mine = [p for p in pods if p.cell == index]
    if all(p.config_hash == current for p in mine):
        return ""
    for i, obs in observe_cells(spec, cells[:index], pods).items():
        if not obs.ready:
            scheduler = "ready" if obs.scheduler_ready else "not ready"
            return (f"cell {index} waits for cell {i} to be ready on the new config before it "
                    f"rolls (cell {i}: scheduler {scheduler}, {obs.workers_ready}/"
                    f"{obs.workers_total} workers ready); cells roll one at a time")
    return ""


async def apply_cell(kube: KubeApi, owner: kopf.Body, spec: TandemSpec, state: ServiceState,
                     cell: Cell) -> None:
    """Create or update a cell's ConfigMap and StatefulSets, after a server-side dry run of
    its pod: Pod Security admission rejects pods (not StatefulSets), so without the dry run a
    rejection would only show as a StatefulSet that never gets pods."""
    template = build_pod_template(spec, cell, "scheduler")
    probe = {"apiVersion": "v1", "kind": "Pod", "spec": template["spec"], "metadata": {
        **template["metadata"], "name": child_name(spec, cell.index, "dry-run"),
        "namespace": spec.namespace}}
    try:
        await kube.dry_run_create(probe)
    except Rejected as e:
        if not e.pod_security:
            raise
        state.rejected[cell.index] = (
            f"{e.message}; the cell's hostPath segment needs namespace {spec.namespace} labelled "
            "pod-security.kubernetes.io/enforce=privileged")
        raise kopf.TemporaryError(f"cell {cell.index}: {state.rejected[cell.index]}; trying "
                                  "again in 60 s", delay=60) from e
    state.rejected.pop(cell.index, None)
    objs = [build_configmap(spec, cell), build_statefulset(spec, cell, "scheduler"),
            build_statefulset(spec, cell, "worker")]
    kopf.adopt(objs, owner=owner)
    for obj in objs:
        await kube.apply(obj)


async def apply_services(kube: KubeApi, owner: kopf.Body, spec: TandemSpec,
                         cells: Sequence[Cell]) -> Front:
    """Apply the Services and what the routing mode runs in front of the cells (the endpoint
    picker with InferencePools or with Envoy); delete what it does not run. Return the
    Front applied.

    The Service moves to Envoy only once one of its pods is available (until then it keeps
    balancing over the schedulers), and back to the schedulers before it is deleted.
    """
    front: list[dict[str, Any]] = []
    if spec.routing.mode == "gateway":  # its account first: the pods run as it
        front = [build_epp_service_account(spec), build_epp_role(spec),
                 build_epp_role_binding(spec)]
    if spec.picked:
        front = [*front, build_epp_configmap(spec, cells), build_epp_deployment(spec, cells),
                 build_epp_service(spec)]
    if spec.front == "envoy":
        front = [*front, build_envoy_configmap(spec, cells),
                 build_envoy_deployment(spec, cells)]
    kopf.adopt(front, owner=owner)
    for obj in front:
        await kube.apply(obj)
    wanted_pools = pools(spec) if spec.routing.mode == "gateway" else []
    for name, protocol, port in wanted_pools:
        pool = build_inference_pool(spec, name, protocol, port)
        kopf.adopt(pool, owner=owner)
        await kube.apply(pool)
    target = "scheduler"
    if spec.front != "scheduler" and front_available(await kube.read(
            "Deployment", spec.namespace, FRONT_NAMES[spec.front](spec))):
        target = spec.front
    objs = [build_service(spec, front=target), build_service(spec, headless=True),
            build_workers_service(spec)]
    kopf.adopt(objs, owner=owner)
    for obj in objs:
        await kube.apply(obj)
    await _delete_unused_routing(kube, spec, {name for name, _, _ in wanted_pools})
    return Front(target, Front.wanted(spec, cells).cells)


async def _delete_unused_routing(kube: KubeApi, spec: TandemSpec, kept_pools: set[str]) -> None:
    """What another routing mode, an earlier spec or an earlier operator version (its
    `tandem router`) left: already gone is fine, and so is an InferencePool kind the cluster
    does not know (404 either way)."""
    await kube.delete("Deployment", spec.namespace, spec.name + LEGACY_ROUTER_SUFFIX)
    await kube.delete("ConfigMap", spec.namespace, spec.name + LEGACY_ROUTER_SUFFIX)
    if spec.front != "envoy":
        await kube.delete("Deployment", spec.namespace, envoy_name(spec))
        await kube.delete("ConfigMap", spec.namespace, envoy_name(spec))
    if not spec.picked:
        await kube.delete("Deployment", spec.namespace, epp_name(spec))
        await kube.delete("ConfigMap", spec.namespace, epp_name(spec))
        await kube.delete("Service", spec.namespace, epp_name(spec))
    if spec.routing.mode != "gateway":
        for kind in ("RoleBinding", "Role", "ServiceAccount"):
            await kube.delete(kind, spec.namespace, epp_name(spec))
    for protocol in (GRPC_POOL[0], HTTP_POOL[0]):
        if pool_name(spec, protocol) not in kept_pools:
            await kube.delete("InferencePool", spec.namespace, pool_name(spec, protocol))


async def apply_front(kube: KubeApi, owner: kopf.Body, spec: TandemSpec,
                      state: ServiceState) -> None:
    """`apply_services` for the recorded cells, remembering what it applied.

    The `services` sub-handler calls it on every spec change; the observe timer calls it
    whenever `state.front` differs from what the spec wants, which switches the Service once
    Envoy is available, and converges a spec that changed again while kopf was still
    handling the previous change (kopf does not re-run sub-handlers that already succeeded).
    """
    async with state.lock:
        state.front = await apply_services(kube, owner, spec, state.cells)


async def cleanup_generation(kube: KubeApi, owner: kopf.Body, spec: TandemSpec, cell: int,
                             node: str, generation: int) -> str:
    """Remove one old segment generation from a node the cell left; return what was done."""
    job = build_cleanup_job(spec, cell, node, generation)
    kopf.adopt(job, owner=owner)
    await kube.apply(job, create_only=True)
    return f"started Job {job['metadata']['name']} to remove generation {generation} from {node}"


async def prune_cells(kube: KubeApi, owner: kopf.Body, spec: TandemSpec,
                      nodes: Mapping[str, NodeInfo]) -> list[str]:
    """Delete the children of cells at or beyond `spec.cells` (a scale-down), found by listing
    so that nothing is missed after a restart, and clean their segments; return what was done,
    one message per cell."""
    selector = f"{INSTANCE_LABEL}={spec.name},{COMPONENT_LABEL}=scheduler"
    done = []
    for sts in await kube.list("StatefulSet", spec.namespace, selector):
        meta = sts["metadata"]
        index = int(meta["labels"][CELL_LABEL])
        if index < spec.cells:
            continue
        names = [child_name(spec, index, role) for role in ("scheduler", "workers", "config")]
        for kind, role in (("StatefulSet", "scheduler"), ("StatefulSet", "workers"),
                           ("ConfigMap", "config")):
            await kube.delete(kind, spec.namespace, child_name(spec, index, role))
        node = (meta.get("annotations") or {}).get(NODE, "")
        cleaned = f"its node {node} is gone, nothing to clean there"
        if node in nodes:
            generation = int(meta["annotations"].get(GENERATION, "0"))
            cleaned = await cleanup_generation(kube, owner, spec, index, node, generation)
        done.append(f"cell {index} removed (spec.cells is {spec.cells}): deleted StatefulSets "
                    f"{names[0]} and {names[1]} and ConfigMap {names[2]}; {cleaned}")
    return done


async def repair(kube: KubeApi, owner: kopf.Body, spec: TandemSpec, state: ServiceState,
                 nodes: Mapping[str, NodeInfo], loads: Iterable[PodLoad],
                 pods: Sequence[PodInfo]) -> list[str]:
    """Re-place cells whose pods left their node or whose node is gone; return what was done.

    The cell gets a new segment generation (a fresh directory, so no writer ever reopens a
    segment that readers on another node never saw), its children are re-applied, the stray
    pods are deleted (their StatefulSet recreates them on the cell's node) and the old
    generation is removed from the node the cell left.
    """
    obs = observe_cells(spec, state.cells, pods)
    before = {c.index: c for c in state.cells}
    force = frozenset(i for i, o in obs.items() if o.misplaced)
    if not force and len(before) == spec.cells and all(c.node in nodes for c in state.cells):
        return []  # nothing to repair; spec changes are the change handlers' (they roll)
    done = []
    for cell in await place(state, spec, nodes, loads, force):
        old = before.get(cell.index)
        stray = obs[cell.index].misplaced if cell.index in obs else ()
        actions = [f"re-placed it on {cell.node} with a fresh segment (generation "
                   f"{cell.generation})" if cell.node else f"found no node for it: {cell.reason}"]
        if cell.node:
            await apply_cell(kube, owner, spec, state, cell)
        for pod in stray:
            await kube.delete("Pod", spec.namespace, pod.name)
            actions.append(f"deleted pod {pod.name} (its StatefulSet recreates it)")
        if old and old.node in nodes and old.node != cell.node:
            actions.append(await cleanup_generation(kube, owner, spec, cell.index, old.node,
                                                    old.generation))
        done.append(f"cell {cell.index}: {_repair_cause(stray, old)}; the operator "
                    f"{', '.join(actions)}")
    return done


def _repair_cause(stray: Sequence[PodInfo], old: Cell | None) -> str:
    """Why a cell is re-placed, in the words of its repair Event."""
    if stray:
        where = f", not on the cell's node {old.node}" if old and old.node else ""
        return f"its {stray[0].component} pod {stray[0].name} ran on {stray[0].node}{where}"
    return f"its node {old.node} is gone" if old and old.node else "a node fits it now"


def status_payload(spec: TandemSpec, state: ServiceState, pods: Sequence[PodInfo],
                   previous: Mapping[str, Any], now: str, generation: int) -> dict[str, Any]:
    """The whole `status` except observedGeneration, recomputed from state and pods."""
    obs = observe_cells(spec, state.cells, pods)
    verdicts = {**fold_verdicts(spec, state.cells, obs, state.rejected), **state.sizing}
    return {
        "cells": [cell_status(spec, c, config_hash(cell_config(spec, c)), obs.get(c.index))
                  for c in state.cells],
        "conditions": render_conditions(verdicts, previous.get("conditions") or (), now,
                                        generation),
        "cache": state.cache_status,
        "replicas": sum(1 for p in pods if p.component == "scheduler" and not p.deleting),
        "selector": scale_selector(spec),
        "endpoint": endpoint(spec),
    }


def job_finished(job: Mapping[str, Any] | None) -> bool:
    """A Job that completed or failed for good (a missing Job counts as finished)."""
    if job is None:
        return True
    status = job.get("status") or {}
    return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
               for c in status.get("conditions") or ())


async def cleanup_segments(kube: KubeApi, owner: kopf.Body, spec: TandemSpec,
                           cells: Sequence[Cell], nodes: Mapping[str, NodeInfo],
                           ) -> tuple[list[str], list[str]]:
    """Start (idempotently) one Job per cell that removes its directory on its node; return
    (Jobs still running, cells skipped because their node is gone)."""
    pending, skipped = [], []
    for cell in cells:
        if not cell.node:
            continue  # never placed: nothing on any node
        where = f"{cell_dir(spec, cell.index)} on {cell.node}"
        if cell.node not in nodes:
            skipped.append(f"cell {cell.index}: its node is gone, so {where} was not removed "
                           "(remove it by hand if the node comes back)")
            continue
        job = build_cleanup_job(spec, cell.index, cell.node)
        kopf.adopt(job, owner=owner)
        await kube.apply(job, create_only=True)
        name = job["metadata"]["name"]
        if not job_finished(await kube.read("Job", spec.namespace, name)):
            pending.append(f"Job {name} removes {where}")
    return pending, skipped
