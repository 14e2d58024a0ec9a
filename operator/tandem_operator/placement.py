"""Node choice and cache sizing for the cells of a TandemService: pure functions over indexes.

A cell must sit on one node (its scheduler and workers share a hostPath directory), and the
cache it gets depends on that node's memory, so the operator chooses the node itself instead
of leaving it to kube-scheduler, and pins the cell there with required node affinity. The
inputs are what the operator's kopf indexes hold: `NodeInfo` per node and `PodLoad` per
scheduled pod; the output is one `Cell` per index, the record kept in `status.cells`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes.utils import parse_quantity

from tandem_operator.spec import TandemSpec

MANAGED_BY = ("app.kubernetes.io/managed-by", "tandem-operator")
INSTANCE_LABEL = "app.kubernetes.io/instance"


def resource_amount(resource: str, quantity: int | str) -> int:
    """Integer amount of a resource: millicores for cpu, bytes or a count for the rest."""
    value = parse_quantity(quantity)
    return math.ceil(value * 1000 if resource == "cpu" else value)


def format_bytes(n: int) -> str:
    """Short binary-unit rendering for messages ("3.5Gi")."""
    for unit, size in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


@dataclass(frozen=True)
class NodeInfo:
    """What placement needs to know about a node (the value of the operator's node index)."""

    name: str
    labels: Mapping[str, str]
    taints: tuple[Mapping[str, str], ...]
    allocatable: Mapping[str, int]  # resource -> resource_amount
    schedulable: bool  # Ready and not cordoned


def node_info(body: Mapping[str, Any]) -> NodeInfo:
    status, spec = body.get("status") or {}, body.get("spec") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or ())
    return NodeInfo(
        name=body["metadata"]["name"],
        labels=dict(body["metadata"].get("labels") or {}),
        taints=tuple(spec.get("taints") or ()),
        allocatable={k: resource_amount(k, v)
                     for k, v in (status.get("allocatable") or {}).items()},
        schedulable=ready and not spec.get("unschedulable", False),
    )


@dataclass(frozen=True)
class PodLoad:
    """The requests a scheduled, unfinished pod holds on its node."""

    node: str
    owner: str  # "<namespace>/<instance>" for pods of a TandemService, else ""
    requests: Mapping[str, int]


def pod_requests(pod_spec: Mapping[str, Any]) -> dict[str, int]:
    """Effective requests as kube-scheduler counts them: max(sum of containers, any init)."""
    total: Counter[str] = Counter()
    for c in pod_spec.get("containers") or ():
        for k, v in ((c.get("resources") or {}).get("requests") or {}).items():
            total[k] += resource_amount(k, v)
    for c in pod_spec.get("initContainers") or ():
        for k, v in ((c.get("resources") or {}).get("requests") or {}).items():
            total[k] = max(total[k], resource_amount(k, v))
    return dict(total)


def pod_load(body: Mapping[str, Any]) -> PodLoad | None:
    spec, meta = body.get("spec") or {}, body["metadata"]
    phase = (body.get("status") or {}).get("phase")
    if not spec.get("nodeName") or phase in ("Succeeded", "Failed"):
        return None
    labels = meta.get("labels") or {}
    owner = ""
    if labels.get(MANAGED_BY[0]) == MANAGED_BY[1] and INSTANCE_LABEL in labels:
        owner = f"{meta.get('namespace', '')}/{labels[INSTANCE_LABEL]}"
    return PodLoad(node=spec["nodeName"], owner=owner, requests=pod_requests(spec))


def cell_requests(spec: TandemSpec) -> dict[str, int]:
    """A cell's pod requests without the cache (the cache is sized per node and added)."""
    need: Counter[str] = Counter()
    for k, v in spec.scheduler.resources.requests.items():
        need[k] += resource_amount(k, v)
    for k, v in spec.worker.resources.requests.items():
        need[k] += resource_amount(k, v) * spec.worker.workers_per_cell
    if spec.worker.gpu_count:
        need[spec.worker.gpu_resource] += spec.worker.gpu_count * spec.worker.workers_per_cell
    return dict(need)


def tolerates(tolerations: Iterable[Mapping[str, Any]], taint: Mapping[str, str]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t["key"] == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def _expression_holds(expr: Mapping[str, Any], value: str | None) -> bool:
    op, values = expr["operator"], expr.get("values") or []
    if op == "In":
        return value in values
    if op == "NotIn":
        return value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if value is None or not value.lstrip("-").isdigit():
        return False
    return int(value) > int(values[0]) if op == "Gt" else int(value) < int(values[0])


def matches_required_affinity(affinity: Mapping[str, Any], node: NodeInfo) -> bool:
    """Required node affinity: any term holds, and within a term every expression holds."""
    required = (affinity.get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return True
    for term in required.get("nodeSelectorTerms") or ():
        exprs = [(e, node.labels.get(e["key"])) for e in term.get("matchExpressions") or ()]
        exprs += [(e, node.name if e["key"] == "metadata.name" else None)
                  for e in term.get("matchFields") or ()]
        if exprs and all(_expression_holds(e, v) for e, v in exprs):
            return True
    return False


@dataclass(frozen=True)
class NodeFit:
    """Whether one cell fits on one node: the cache bytes it would get, or why not."""

    cache_bytes: int | None  # None = does not fit
    reason: str = ""


def cell_cache_request(spec: TandemSpec, prev: Cell | None) -> int:
    """The cache bytes a cell asks for: the spec's size; under autoSize, the size the
    operator chose for it before (its `requestedBytes`), kept within the bounds, a new cell
    starting from the spec's size."""
    requested, auto = spec.cache_bytes_requested, spec.cache.auto_size
    if requested == 0 or auto is None:
        return requested
    chosen = prev.requested_bytes if prev is not None and prev.requested_bytes else requested
    return min(max(chosen, auto.min), auto.max)


def _cache_budget(spec: TandemSpec, node: NodeInfo, used: Mapping[str, int]) -> int:
    """maxNodeMemoryPercent of the node's allocatable memory minus the memory requests of
    everything else on it (`used`) and of the cell's own pods."""
    return (node.allocatable.get("memory", 0) * spec.cache.max_node_memory_percent // 100
            - used.get("memory", 0) - cell_requests(spec).get("memory", 0))


def node_fit(spec: TandemSpec, node: NodeInfo, used: Mapping[str, int],
             cells_there: int, requested: int | None = None) -> NodeFit:
    """Fit a cell on `node`, whose other pods already use `used`, next to `cells_there` cells.

    The cache gets min(`requested` (default: the spec's), the budget of `_cache_budget`).
    """
    if not node.schedulable:
        return NodeFit(None, "not Ready or cordoned")
    if any(node.labels.get(k) != v for k, v in spec.placement.node_selector.items()):
        return NodeFit(None, "node selector does not match")
    if not matches_required_affinity(spec.placement.affinity, node):
        return NodeFit(None, "required node affinity does not match")
    for taint in node.taints:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(
                spec.placement.tolerations, taint):
            return NodeFit(None, f"taint {taint.get('key')}={taint.get('value', '')}:"
                                 f"{taint.get('effect')} not tolerated")
    if cells_there >= spec.placement.max_cells_per_node:
        return NodeFit(None, f"maxCellsPerNode={spec.placement.max_cells_per_node} reached")
    need = cell_requests(spec)
    for resource, amount in sorted(need.items()):
        free = node.allocatable.get(resource, 0) - used.get(resource, 0)
        if amount > free:
            show = format_bytes if resource == "memory" else str
            return NodeFit(None, f"needs {show(amount)} {resource}, {show(max(free, 0))} free")
    requested = spec.cache_bytes_requested if requested is None else requested
    if requested == 0:
        return NodeFit(0)
    budget = _cache_budget(spec, node, used)
    if budget <= 0:
        return NodeFit(None, f"no memory left for the cache within "
                             f"{spec.cache.max_node_memory_percent}% of allocatable")
    return NodeFit(min(requested, budget))


@dataclass(frozen=True)
class Cell:
    """Where one cell lives: the record in `status.cells[index]`.

    Invariants: `node == ""` exactly when `reason != ""` (unplaced cells say why);
    `cache_bytes <= requested_bytes`; `generation` grows by one each time the cell gets a new
    node or cache size, and names the segment directory, so a stale writer never shares one.
    """

    index: int
    node: str
    cache_bytes: int
    requested_bytes: int
    generation: int
    reason: str = ""

    def check_invariants(self) -> None:
        assert (self.node == "") == (self.reason != ""), self
        assert 0 <= self.cache_bytes <= self.requested_bytes or self.node == "", self
        assert self.generation >= 0, self


def _usage(loads: Iterable[PodLoad], owner: str) -> dict[str, Counter[str]]:
    used: dict[str, Counter[str]] = {}
    for load in loads:
        if load.owner != owner:
            used.setdefault(load.node, Counter()).update(load.requests)
    return used


def _reserve(used: dict[str, Counter[str]], node: str, spec: TandemSpec, cache: int) -> None:
    used.setdefault(node, Counter()).update(cell_requests(spec))
    used[node]["memory"] += cache


def _misfit_summary(fits: Mapping[str, NodeFit], total: int) -> str:
    shown = [f"{name}: {fit.reason}" for name, fit in sorted(fits.items())][:5]
    more = f"; {len(fits) - 5} more" if len(fits) > 5 else ""
    return f"0/{total} nodes fit" + (": " + "; ".join(shown) + more if shown else "")


def place_cells(spec: TandemSpec, nodes: Mapping[str, NodeInfo], loads: Iterable[PodLoad],
                previous: Sequence[Cell], force: frozenset[int] = frozenset(),
                resize: Mapping[int, int] | None = None) -> list[Cell]:
    """Choose a node and a cache size for each of `spec.cells` cells.

    A placed cell stays where it is (same cache bytes, same generation) while its node exists,
    still fits it and the requested size is unchanged, so restarts and unrelated pods never
    move a cell; cells in `force` are placed afresh (a repair). New placements prefer the old
    node, then the largest cache, then the node left with the fewest free GPUs (packing).
    `resize` gives cells a new requested size (autoSize); the others ask for
    `cell_cache_request`.
    """
    owner = f"{spec.namespace}/{spec.name}"
    used = _usage(loads, owner)
    prev = {c.index: c for c in previous if c.index < spec.cells}
    resize = resize or {}
    wanted = {i: resize.get(i, cell_cache_request(spec, prev.get(i))) for i in range(spec.cells)}
    cells: dict[int, Cell] = {}
    for i, p in sorted(prev.items()):
        node = nodes.get(p.node)
        if not node or i in force or p.requested_bytes != wanted[i]:
            continue
        fit = node_fit(spec, node, used.get(node.name, Counter()), _count(cells, node.name),
                       wanted[i])
        if fit.cache_bytes is not None:
            cells[i] = p
            _reserve(used, p.node, spec, p.cache_bytes)
    for i in range(spec.cells):
        if i not in cells:
            cells[i] = _place_one(spec, i, prev.get(i), nodes, used, cells, wanted[i])
            if cells[i].node:
                _reserve(used, cells[i].node, spec, cells[i].cache_bytes)
    return [cells[i] for i in range(spec.cells)]


def cache_room(spec: TandemSpec, nodes: Mapping[str, NodeInfo], loads: Iterable[PodLoad],
               cells: Sequence[Cell], index: int) -> int:
    """The most cache bytes cell `index` could get on its node, everything else staying as
    it is: what bounds its recommendation (0 when it has no node)."""
    cell = cells[index]
    node = nodes.get(cell.node)
    if node is None:
        return 0
    used = _usage(loads, f"{spec.namespace}/{spec.name}")
    for other in cells:
        if other.index != index and other.node == cell.node:
            _reserve(used, other.node, spec, other.cache_bytes)
    return max(_cache_budget(spec, node, used.get(node.name, Counter())), 0)


def _place_one(spec: TandemSpec, index: int, prev: Cell | None, nodes: Mapping[str, NodeInfo],
               used: dict[str, Counter[str]], cells: Mapping[int, Cell], requested: int) -> Cell:
    fits = {n.name: node_fit(spec, n, used.get(n.name, Counter()), _count(cells, n.name),
                             requested)
            for n in nodes.values()}
    generation = prev.generation if prev else 0
    ok = [(name, f.cache_bytes) for name, f in fits.items() if f.cache_bytes is not None]
    if not ok:
        return Cell(index, "", 0, requested, generation, _misfit_summary(fits, len(nodes)))
    gpu = spec.worker.gpu_resource

    def rank(item: tuple[str, int | None]) -> tuple[Any, ...]:
        name, cache = item
        spare = nodes[name].allocatable.get(gpu, 0) - used.get(name, Counter())[gpu]
        return (not (prev and prev.node == name), -(cache or 0), spare, name)

    name, cache = min(ok, key=rank)
    return Cell(index, name, cache or 0, requested, generation + 1)


def _count(cells: Mapping[int, Cell], node: str) -> int:
    return sum(1 for c in cells.values() if c.node == node)
