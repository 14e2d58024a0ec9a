"""Observed state of a TandemService's cells and the status conditions folded from it.

Pure functions over the operator's pod index: the timer calls them every few seconds and
writes the result to `status`, so `status` is level-based (recomputed from what exists), not a
log of what the handlers did.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem_operator.manifests import (
    CELL_LABEL,
    COMPONENT_LABEL,
    CONFIG_HASH,
    child_name,
    segment_path,
)
from tandem_operator.placement import Cell, format_bytes
from tandem_operator.spec import TandemSpec

FOLDED = ("PlacementReady", "Colocated", "CacheReady", "SchedulerReady", "WorkersReady")
"""`Ready` is True when all of these are; else it carries the reason of the first false one."""
PROBLEM_CHARS = 300  # of one container's message in a condition (a condition holds 1024)
SHOWN_PROBLEMS = 3  # distinct pod problems a condition quotes; the others are counted
# Waiting reasons of a container on its way up, not problems.
_STARTING = frozenset({"ContainerCreating", "PodInitializing"})


@dataclass(frozen=True)
class PodInfo:
    """A Tandem pod as the operator's index holds it."""

    name: str
    component: str
    cell: int
    node: str  # "" while unscheduled
    ready: bool
    config_hash: str
    deleting: bool
    problem: str = ""  # why it does not come up, after "<component> pod <name> " (pod_problem)
    ip: str = ""  # status.podIP: where the operator reads a scheduler's CacheStats


def _last_line(text: str) -> str:
    """The last non-empty line, cut to PROBLEM_CHARS. With FallbackToLogsOnError the message
    is the tail of the container's log, and a process that cannot start prints its one-line
    error last (after a traceback, if any)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= PROBLEM_CHARS else line[:PROBLEM_CHARS - 1] + "…"


def _container_problem(c: Mapping[str, Any], init: bool) -> str:
    """A container that exited with an error (now or last time), or waits for a reason other
    than starting up (ImagePullBackOff, CreateContainerConfigError...); "" otherwise."""
    state = c.get("state") or {}
    waiting = (state.get("waiting") or {}).get("reason", "")
    where = f" in init container {c.get('name', '')}" if init else ""
    # Now, else last time (it runs again); a loop on a clean exit is a problem too.
    last = state.get("terminated") or (c.get("lastState") or {}).get("terminated") or {}
    looping = waiting == "CrashLoopBackOff"
    if last and (last.get("exitCode") or looping):
        facts = f"{last.get('reason') or 'Error'}, exit code {last.get('exitCode', 0)}"
        line = _last_line(last.get("message") or "")
        verb = "is crash-looping" if looping else "failed"
        return f"{verb}{where}: {line} ({facts})" if line else f"{verb}{where}: {facts}"
    if waiting and waiting not in _STARTING:
        line = _last_line((state.get("waiting") or {}).get("message") or "")
        return f"is waiting{where}: {waiting}" + (f": {line}" if line else "")
    return ""


def pod_problem(body: Mapping[str, Any]) -> str:
    """Why a cell's pod does not come up, as the rest of a sentence that starts with
    "<component> pod <name> "; "" when nothing is known to be wrong.

    In order: a container (init containers first) that failed, with the last line of its
    termination message (a model that cannot be loaded names its file and key there), or that
    waits for a reason other than starting; else a pod kube-scheduler cannot place (e.g.
    `persistentvolumeclaim "models" not found`). A ready container has no problem, whatever
    it went through before.
    """
    status = body.get("status") or {}
    for init, key in ((True, "initContainerStatuses"), (False, "containerStatuses")):
        for c in status.get(key) or ():
            problem = "" if c.get("ready") else _container_problem(c, init)
            if problem:
                return problem
    for cond in status.get("conditions") or ():
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            line = _last_line(cond.get("message") or "")
            return f"cannot be scheduled: {line or cond.get('reason', 'Unschedulable')}"
    return ""


def pod_info(body: Mapping[str, Any]) -> PodInfo | None:
    meta, status = body["metadata"], body.get("status") or {}
    labels = meta.get("labels") or {}
    component = labels.get(COMPONENT_LABEL, "")
    if component not in ("scheduler", "worker") or not labels.get(CELL_LABEL, "").isdigit():
        return None  # cleanup Jobs' pods are not part of a cell
    return PodInfo(
        name=meta["name"],
        component=component,
        cell=int(labels[CELL_LABEL]),
        node=(body.get("spec") or {}).get("nodeName") or "",
        ready=any(c.get("type") == "Ready" and c.get("status") == "True"
                  for c in status.get("conditions") or ()),
        config_hash=(meta.get("annotations") or {}).get(CONFIG_HASH, ""),
        deleting=bool(meta.get("deletionTimestamp")),
        problem=pod_problem(body),
        ip=status.get("podIP") or "",
    )


@dataclass(frozen=True)
class CellObservation:
    """What one cell's pods look like now, against the cell's placement and config."""

    scheduler_ready: bool
    workers_ready: int
    workers_total: int
    misplaced: tuple[PodInfo, ...]  # pods scheduled on another node than the cell's
    failing: tuple[PodInfo, ...] = ()  # pods not ready with a problem (pod_problem)

    @property
    def ready(self) -> bool:
        return self.scheduler_ready and self.workers_ready == self.workers_total


def observe_cell(spec: TandemSpec, cell: Cell, config_hash: str,
                 pods: Iterable[PodInfo]) -> CellObservation:
    """Count ready pods that run the current config; pods of an older config are rolling."""
    mine = [p for p in pods if p.cell == cell.index and not p.deleting]
    current = [p for p in mine if p.ready and p.config_hash == config_hash]
    return CellObservation(
        scheduler_ready=any(p.component == "scheduler" for p in current),
        workers_ready=sum(1 for p in current if p.component == "worker"),
        workers_total=spec.worker.workers_per_cell,
        misplaced=tuple(p for p in mine if cell.node and p.node and p.node != cell.node),
        failing=tuple(p for p in mine if p.problem and not p.ready),
    )


def cell_status(spec: TandemSpec, cell: Cell, config_hash: str,
                obs: CellObservation | None) -> dict[str, Any]:
    """One `status.cells[]` entry."""
    state = ("Unplaced" if not cell.node else "Misplaced" if obs and obs.misplaced
             else "Ready" if obs and obs.ready else "Starting")
    return {
        "index": cell.index,
        "nodeName": cell.node,
        "segmentPath": segment_path(spec, cell) if cell.node else "",
        "segmentBytes": cell.cache_bytes,
        "requestedBytes": cell.requested_bytes,
        "segmentGeneration": cell.generation,
        "configHash": config_hash,
        "schedulerReady": bool(obs and obs.scheduler_ready),
        "workersReady": obs.workers_ready if obs else 0,
        "workersTotal": spec.worker.workers_per_cell,
        "state": state,
    }


Verdict = tuple[str, str, str]  # (status "True"/"False", reason, message)


def placement_verdict(cells: Sequence[Cell], rejected: Mapping[int, str]) -> Verdict:
    unplaced = [c for c in cells if not c.node]
    if unplaced:
        return "False", "NoFittingNode", "; ".join(f"cell {c.index}: {c.reason}" for c in unplaced)
    if rejected:
        return "False", "PodSecurityRejected", "; ".join(
            f"cell {i}: {msg}" for i, msg in sorted(rejected.items()))
    return "True", "Placed", ", ".join(f"cell {c.index} on {c.node}" for c in cells) or "no cells"


def cache_verdict(spec: TandemSpec, cells: Sequence[Cell]) -> Verdict:
    if spec.cache_bytes_requested == 0:
        return "True", "Disabled", f"featureCache.type={spec.cache.type}, size {spec.cache.size}"
    unplaced = [f"cell {c.index}" for c in cells if not c.node]
    if unplaced:
        return "False", "NotSized", f"{', '.join(unplaced)}: no node yet to size the cache on"
    sizes = ", ".join(f"cell {c.index}: {format_bytes(c.cache_bytes)}" for c in cells)
    if any(c.cache_bytes < c.requested_bytes for c in cells):
        return ("True", "SizeReduced", f"{sizes} of {format_bytes(spec.cache_bytes_requested)} "
                f"requested (capped at {spec.cache.max_node_memory_percent}% of node memory)")
    return "True", "Sized", sizes


def _problems(failing: Sequence[PodInfo]) -> list[str]:
    """One sentence per distinct problem, naming its first pod and counting the pods alike
    (every worker of a cell fails alike on a bad model); at most SHOWN_PROBLEMS of them.

    Workers come first: a scheduler that gave up waiting for its workers is failing too, but
    as a consequence.
    """
    alike: dict[str, list[PodInfo]] = {}
    for p in sorted(failing, key=lambda p: (p.component != "worker", p.cell, p.name)):
        alike.setdefault(f"{p.component} {p.problem}", []).append(p)
    out = []
    for pods in alike.values():
        more = f" (and {len(pods) - 1} more pods alike)" if len(pods) > 1 else ""
        out.append(f"{pods[0].component} pod {pods[0].name} {pods[0].problem}{more}")
    if len(out) > SHOWN_PROBLEMS:
        out[SHOWN_PROBLEMS:] = [f"and {len(out) - SHOWN_PROBLEMS} more pod problems"]
    return out


def _ready_verdict(what: str, ready: int, total: int, reason: str,
                   waiting: Sequence[str], failing: Sequence[PodInfo]) -> Verdict:
    """`waiting` names the StatefulSets short of ready pods: `kubectl describe` on one shows
    its pods, or why it could not create them. The problems of `failing` pods come first:
    they are what a user must fix, and the message is cut at 1024 characters."""
    if ready == total:
        return "True", "Ready", f"{ready}/{total} {what} ready"
    return "False", reason, "; ".join([
        *_problems(failing),
        f"{ready}/{total} {what} ready on the current config; waiting for {', '.join(waiting)}"])


def _waiting(spec: TandemSpec, cells: Sequence[Cell], obs: Mapping[int, CellObservation],
             component: str) -> list[str]:
    """The cells' StatefulSets of `component` whose pods are not all ready."""
    out = []
    for c in cells:
        o = obs.get(c.index)
        unplaced = "" if c.node else "cell not placed"
        if component == "scheduler" and not (o and o.scheduler_ready):
            shown = f" ({unplaced})" if unplaced else ""
            out.append(f"StatefulSet {child_name(spec, c.index, 'scheduler')}{shown}")
        elif component == "worker" and not (o and o.workers_ready == o.workers_total):
            ready = f"{o.workers_ready if o else 0}/{spec.worker.workers_per_cell} ready"
            shown = ", ".join(s for s in (ready, unplaced) if s)
            out.append(f"StatefulSet {child_name(spec, c.index, 'workers')} ({shown})")
    return out


def fold_verdicts(spec: TandemSpec, cells: Sequence[Cell], obs: Mapping[int, CellObservation],
                  rejected: Mapping[int, str]) -> dict[str, Verdict]:
    """Every condition but Ready, in FOLDED order."""
    misplaced = [p for o in obs.values() for p in o.misplaced]
    node_of = {c.index: c.node for c in cells}
    # A scheduler turns Ready only once its workers are attached, so a cell's failing pods,
    # workers included, are why its scheduler is not Ready (and Ready names them).
    waiting_cells = [o for o in obs.values() if not o.scheduler_ready]
    return {
        "PlacementReady": placement_verdict(cells, rejected),
        "Colocated": ("False", "NotColocated", "; ".join(
            f"{p.component} pod {p.name} of cell {p.cell} runs on {p.node}, not on the cell's "
            f"node {node_of.get(p.cell)}" for p in misplaced) + ": the operator re-places the cell")
        if misplaced else ("True", "Colocated", "every pod runs on its cell's node"),
        "CacheReady": cache_verdict(spec, cells),
        "SchedulerReady": _ready_verdict(
            "schedulers", sum(o.scheduler_ready for o in obs.values()), len(cells),
            "SchedulersNotReady", _waiting(spec, cells, obs, "scheduler"),
            [p for o in waiting_cells for p in o.failing]),
        "WorkersReady": _ready_verdict(
            "workers", sum(o.workers_ready for o in obs.values()),
            len(cells) * spec.worker.workers_per_cell, "WorkersNotReady",
            _waiting(spec, cells, obs, "worker"),
            [p for o in obs.values() for p in o.failing if p.component == "worker"]),
    }


def ready_verdict(verdicts: Mapping[str, Verdict]) -> Verdict:
    """Fold: the first false condition in FOLDED order decides Ready's reason and message."""
    for kind in FOLDED:
        status, reason, message = verdicts[kind]
        if status != "True":
            return "False", reason, message
    return "True", "Ready", verdicts["PlacementReady"][2]


def render_conditions(verdicts: Mapping[str, Verdict], previous: Iterable[Mapping[str, Any]],
                      now: str, generation: int) -> list[dict[str, Any]]:
    """Conditions with Ready first; lastTransitionTime moves only when a status changes."""
    old = {c.get("type"): c for c in previous}
    out = []
    for kind, (status, reason, message) in {"Ready": ready_verdict(verdicts), **verdicts}.items():
        before = old.get(kind) or {}
        since = before.get("lastTransitionTime") if before.get("status") == status else None
        out.append({"type": kind, "status": status, "reason": reason, "message": message[:1024],
                    "lastTransitionTime": since or now, "observedGeneration": generation})
    return out


def invalid_spec_conditions(message: str, previous: Iterable[Mapping[str, Any]], now: str,
                            generation: int) -> list[dict[str, Any]]:
    """A spec this operator cannot serve: Ready and PlacementReady say why; nothing else is
    known, so the other conditions are Unknown."""
    verdicts: dict[str, Verdict] = {k: ("Unknown", "InvalidSpec", message) for k in FOLDED}
    verdicts["PlacementReady"] = ("False", "InvalidSpec", message)
    return render_conditions(verdicts, previous, now, generation)
