"""The kopf handlers: one decorator, one small function, each a guard and a delegation.

- resume/create/update(spec) `reconcile`: place the cells, then one sub-handler per cell
  (`cell-<i>`, rolled one at a time), `services` (and the routing: endpoint picker, pools,
  Envoy) and `prune` (scale-down).
- timer `observe`: repair colocation and publish the level-based status.
- timer `watch_caches`: read the cells' CacheStats, judge cache sizes and leaking references,
  apply autoSize (cache_watch.py).
- delete `cleanup`: a finalizer that removes the cells' segment directories with Jobs.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from tandem_operator.cache_sizing import SizingPolicy
from tandem_operator.cache_watch import read_caches, size_caches
from tandem_operator.conditions import PodInfo, invalid_spec_conditions, pod_info
from tandem_operator.kube import KubeApi
from tandem_operator.placement import INSTANCE_LABEL, MANAGED_BY, NodeInfo, PodLoad
from tandem_operator.placement import node_info as parse_node
from tandem_operator.placement import pod_load as parse_pod_load
from tandem_operator.reconcile import (
    Front,
    apply_cell,
    apply_front,
    cleanup_segments,
    loads_of,
    nodes_of,
    place,
    prune_cells,
    repair,
    retry_delay,
    roll_blocker,
    service_state,
    status_payload,
    wait_delay,
)
from tandem_operator.spec import GROUP, PLURAL, VERSION, SpecError, TandemSpec, parse_spec
from tandem_operator.tracing import handler_span

RESOURCE = (GROUP, VERSION, PLURAL)
PodIndex = kopf.Index[tuple[str, str], PodInfo]


@dataclass(frozen=True)
class OperatorConfig:
    """Operator-wide knobs from the environment (see docs/operator.md)."""

    resync_seconds: float = 10.0  # TANDEM_OPERATOR_RESYNC_SECONDS: the observe timer's period
    cleanup_timeout_seconds: float = 600.0  # TANDEM_OPERATOR_CLEANUP_TIMEOUT_SECONDS
    cache_seconds: float = 30.0  # TANDEM_OPERATOR_CACHE_SECONDS: how often CacheStats is read
    # TANDEM_OPERATOR_CACHE_MIN_REFERENCES, TANDEM_OPERATOR_LEAK_SECONDS
    sizing: SizingPolicy = field(default_factory=SizingPolicy)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> OperatorConfig:
        policy = SizingPolicy(
            min_references=int(env.get("TANDEM_OPERATOR_CACHE_MIN_REFERENCES",
                                       SizingPolicy.min_references)),
            leak_seconds=float(env.get("TANDEM_OPERATOR_LEAK_SECONDS",
                                       SizingPolicy.leak_seconds)))
        return cls(float(env.get("TANDEM_OPERATOR_RESYNC_SECONDS", cls.resync_seconds)),
                   float(env.get("TANDEM_OPERATOR_CLEANUP_TIMEOUT_SECONDS",
                                 cls.cleanup_timeout_seconds)),
                   float(env.get("TANDEM_OPERATOR_CACHE_SECONDS", cls.cache_seconds)), policy)


# NOTE: read at import because kopf's decorators take the timer period; the rejected
# alternative, registering handlers from a function, would hide them from `kopf run -m`.
CONFIG = OperatorConfig.from_env()


def configure(settings: kopf.OperatorSettings) -> None:
    """Keep kopf's bookkeeping under tandem.dev, bound every watch request, and post handler
    outcomes as Events."""
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.watching.server_timeout = 300  # the apiserver ends each watch after 5 min
    settings.watching.client_timeout = 330  # and we give up on a stuck one shortly after
    settings.watching.connect_timeout = 30
    settings.watching.reconnect_backoff = 1
    settings.posting.reporting_component = "tandem-operator"
    # kopf logs a retry or a permanent failure of a handler at ERROR, on the object's logger;
    # only with `loggers` on do those lines become Events of the object (kubectl describe).
    # NOTE: WARNING, not INFO: INFO would post a "succeeded" Event for every handler run,
    # the observe timer's included. It also drops kopf.info(), so Normal Events are posted
    # with kopf.event().
    settings.posting.loggers = True
    settings.posting.level = logging.WARNING
    if settings.peering.name == "default":  # no --peering given: run alone (one replica)
        settings.peering.standalone = True


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def changed_status(status: Mapping[str, Any], payload: Mapping[str, Any]) -> dict[str, Any]:
    """Only the keys that differ: unchanged status is never re-written (no watch events)."""
    return {k: v for k, v in payload.items() if status.get(k) != v}


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The pod's service account, else $KUBECONFIG, read when kopf logs in (kopf's default
    via the client library would use the KUBECONFIG seen when `kubernetes` was imported)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    configure(settings)
    memo["kube"] = KubeApi.from_environment()


@kopf.on.cleanup()
async def shutdown(memo: kopf.Memo, **_: Any) -> None:
    memo["kube"].close()


@kopf.index("", "v1", "nodes")
def node_index(name: str, body: kopf.Body, **_: Any) -> dict[str, NodeInfo]:
    return {name: parse_node(body)}


@kopf.index("", "v1", "pods")
def pod_load_index(body: kopf.Body, **_: Any) -> dict[str, PodLoad] | None:
    load = parse_pod_load(body)
    return {load.node: load} if load else None


@kopf.index("", "v1", "pods", labels={MANAGED_BY[0]: MANAGED_BY[1]})
def tandem_pod_index(namespace: str, labels: kopf.Labels, body: kopf.Body,
                     **_: Any) -> dict[tuple[str, str], PodInfo] | None:
    info = pod_info(body)
    return {(namespace, labels.get(INSTANCE_LABEL, "")): info} if info else None


def parse_or_report(name: str, namespace: str, spec: kopf.Spec, status: kopf.Status,
                    meta: kopf.Meta, patch: kopf.Patch) -> TandemSpec:
    """The parsed spec; an unservable one is written to the conditions, then PermanentError."""
    try:
        return parse_spec(name, namespace, spec)
    except SpecError as e:
        patch.status["conditions"] = invalid_spec_conditions(
            str(e), status.get("conditions") or (), now(), meta.get("generation", 0))
        raise kopf.PermanentError(str(e)) from e


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
async def reconcile(name: str, namespace: str, spec: kopf.Spec, status: kopf.Status,
                    meta: kopf.Meta, memo: kopf.Memo, patch: kopf.Patch,
                    node_index: kopf.Index[str, NodeInfo], pod_load_index: kopf.Index[str, PodLoad],
                    tandem_pod_index: PodIndex, **_: Any) -> None:
    """Place the cells, then apply each cell, the Services and the scale-down as sub-handlers."""
    with handler_span("reconcile", namespace, name):
        tsvc = parse_or_report(name, namespace, spec, status, meta, patch)
        state = service_state(memo, status)
        await place(state, tsvc, nodes_of(node_index), loads_of(pod_load_index))
        for cell in state.cells:
            step = functools.partial(apply_cell_handler, cell.index)
            kopf.register(step, id=f"cell-{cell.index}")
        kopf.register(services_handler, id="services")
        kopf.register(prune_handler, id="prune")
        pods = list(tandem_pod_index.get((namespace, name), []))
        payload = status_payload(tsvc, state, pods, status, now(), meta["generation"])
        payload["observedGeneration"] = meta["generation"]
        patch.status.update(changed_status(status, payload))


async def apply_cell_handler(index: int, name: str, namespace: str, spec: kopf.Spec,
                             body: kopf.Body, memo: kopf.Memo, retry: int,
                             tandem_pod_index: PodIndex, **_: Any) -> None:
    """Sub-handler `cell-<i>`: wait for a node and for the cells before it, then apply."""
    tsvc, state = parse_spec(name, namespace, spec), memo["tandem_state"]
    if index >= len(state.cells):
        return  # scaled down meanwhile; prune removes it
    cell = state.cells[index]
    if not cell.node:
        delay = retry_delay(retry)
        raise kopf.TemporaryError(f"cell {index} is not placed, {cell.reason}; trying again in "
                                  f"{delay:.0f} s", delay=delay)
    blocker = roll_blocker(tsvc, state.cells, index, list(tandem_pod_index.get((namespace, name),
                                                                               [])))
    if blocker:
        raise kopf.TemporaryError(blocker, delay=wait_delay(retry))
    await apply_cell(memo["kube"], body, tsvc, state, cell)


async def services_handler(name: str, namespace: str, spec: kopf.Spec, body: kopf.Body,
                           memo: kopf.Memo, **_: Any) -> None:
    """Sub-handler `services`: the Services and the routing over the recorded cells; a
    warning event for each deprecated field (the removed router's) on every spec change."""
    tsvc = parse_spec(name, namespace, spec)
    for message in tsvc.deprecations:
        kopf.warn(body, reason="Deprecated", message=message)
    await apply_front(memo["kube"], body, tsvc, memo["tandem_state"])


async def prune_handler(name: str, namespace: str, spec: kopf.Spec, body: kopf.Body,
                        memo: kopf.Memo, node_index: kopf.Index[str, NodeInfo], **_: Any) -> None:
    tsvc = parse_spec(name, namespace, spec)
    for message in await prune_cells(memo["kube"], body, tsvc, nodes_of(node_index)):
        kopf.event(body, type="Normal", reason="CellRemoved", message=message)


@kopf.timer(*RESOURCE, interval=CONFIG.resync_seconds, idle=CONFIG.resync_seconds / 2)
async def observe(name: str, namespace: str, spec: kopf.Spec, status: kopf.Status,
                  meta: kopf.Meta, body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch,
                  node_index: kopf.Index[str, NodeInfo], pod_load_index: kopf.Index[str, PodLoad],
                  tandem_pod_index: PodIndex, **_: Any) -> None:
    """Level-based pass: repair colocation, converge the Service and the routing, then
    publish status recomputed from the pods."""
    with handler_span("observe", namespace, name):
        try:
            tsvc = parse_spec(name, namespace, spec)
        except SpecError as e:
            conditions = invalid_spec_conditions(str(e), status.get("conditions") or (), now(),
                                                 meta["generation"])
            patch.status.update(changed_status(status, {"conditions": conditions}))
            return
        state = service_state(memo, status)
        pods = list(tandem_pod_index.get((namespace, name), []))
        nodes = nodes_of(node_index)
        for message in await repair(memo["kube"], body, tsvc, state, nodes,
                                    loads_of(pod_load_index), pods):
            kopf.warn(body, reason="CellRepaired", message=message)
        if state.front != Front.wanted(tsvc, state.cells):
            await apply_front(memo["kube"], body, tsvc, state)
        payload = status_payload(tsvc, state, pods, status, now(), meta["generation"])
        patch.status.update(changed_status(status, payload))


@kopf.timer(*RESOURCE, interval=CONFIG.cache_seconds, idle=CONFIG.cache_seconds)
async def watch_caches(name: str, namespace: str, spec: kopf.Spec, status: kopf.Status,
                       body: kopf.Body, memo: kopf.Memo, node_index: kopf.Index[str, NodeInfo],
                       pod_load_index: kopf.Index[str, PodLoad], tandem_pod_index: PodIndex,
                       **_: Any) -> None:
    """Read each cell's CacheStats; judge its cache size and its unacknowledged references
    (status is published by `observe`); under autoSize resize at most one cell."""
    with handler_span("watch_caches", namespace, name):
        try:
            tsvc = parse_spec(name, namespace, spec)
        except SpecError:
            return  # `observe` reports it
        state = service_state(memo, status)
        pods = list(tandem_pod_index.get((namespace, name), []))
        now = time.monotonic()
        await read_caches(memo["kube"], tsvc, state, pods, now)
        done = await size_caches(memo["kube"], body, tsvc, state, nodes_of(node_index),
                                 loads_of(pod_load_index), pods, CONFIG.sizing, now)
        for message in done.new_leaks:
            kopf.warn(body, reason="ReferencesLeaking", message=message)
        if done.resized:
            kopf.event(body, type="Normal", reason="CacheResized", message=done.resized)


@kopf.on.delete(*RESOURCE)
async def cleanup(name: str, namespace: str, spec: kopf.Spec, status: kopf.Status,
                  body: kopf.Body, memo: kopf.Memo, retry: int, runtime: datetime.timedelta,
                  node_index: kopf.Index[str, NodeInfo], **_: Any) -> None:
    """Finalizer: remove every cell's directory from its node, then let the object go.

    Never blocks for good: cells on vanished nodes are skipped, and after the cleanup timeout
    the remaining Jobs are abandoned with a warning Event.
    """
    with handler_span("cleanup", namespace, name):
        try:  # without the rules: an older operator may have placed cells of such a spec
            tsvc = parse_spec(name, namespace, spec, check_rules=False)
        except SpecError:
            return  # the CRD's defaults are missing: this spec was never served
        cells = service_state(memo, status).cells
        pending, skipped = await cleanup_segments(memo["kube"], body, tsvc, cells,
                                                  nodes_of(node_index))
        if skipped and retry == 0:
            kopf.warn(body, reason="CleanupSkipped", message="; ".join(skipped))
        if pending and runtime.total_seconds() < CONFIG.cleanup_timeout_seconds:
            raise kopf.TemporaryError(f"deletion waits for the cleanup Jobs: {'; '.join(pending)}",
                                      delay=wait_delay(retry))
        if pending:
            kopf.warn(body, reason="CleanupTimedOut", message=(
                f"gave up after {CONFIG.cleanup_timeout_seconds:.0f} s waiting for the cleanup "
                f"Jobs, and released the object: {'; '.join(pending)}; remove those directories "
                "by hand once nothing of the cell runs there"))
