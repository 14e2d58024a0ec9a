"""Pure builders for a cell's workloads: the scheduler and worker StatefulSets.

Both are StatefulSets: a StatefulSet never runs two pods of one ordinal at once, which is what
a single segment writer needs (the scheduler), and it labels each pod with its ordinal
(`apps.kubernetes.io/pod-index`), which the workers read as their rank through the Downward API.
"""

from __future__ import annotations

import copy
from typing import Any

from tandem_operator.containers import (
    SCRATCH_MOUNT,
    ServingContainer,
    container_resources,
    root_task_container,
    scratch_volume,
    serving_container,
    serving_pod_spec,
)
from tandem_operator.manifests import (
    CELL_LABEL,
    CELL_MOUNT,
    COMPONENT_LABEL,
    CONFIG_HASH,
    ENGINE_TYPE_LABELS,
    GENERATION,
    NODE,
    SCHEDULER_METRICS_PORT,
    SHM_MOUNT,
    WORKER_METRICS_PORT,
    cell_config,
    cell_dir,
    child_name,
    config_hash,
    generation_dir,
    labels,
    selector_labels,
    service_name,
    tls_volumes,
    workers_service_name,
)
from tandem_operator.placement import INSTANCE_LABEL, Cell
from tandem_operator.spec import ModelSpec, TandemSpec

HOSTNAME = "kubernetes.io/hostname"
# Prepares the cell directory before any Tandem process touches it: kubelet creates hostPath
# and subPath directories as root 0755, where a non-root scheduler could not write. Pruning
# removes only older generations, never a newer one a rolled pod may already use.
_PREPARE = """set -eu
dir="$1"; gen="$2"; owner="$3"; prune="$4"
mkdir -p "$dir/gen-$gen"
if [ "$prune" = true ]; then
  for old in "$dir"/gen-*; do
    n="${old##*/gen-}"
    case "$n" in ''|*[!0-9]*) continue ;; esac
    if [ "$n" -lt "$gen" ]; then rm -rf -- "$old"; fi
  done
fi
chown "$owner" "$dir/gen-$gen"
chmod 0700 "$dir/gen-$gen"
"""

def _prepare_container(spec: TandemSpec, cell: Cell, prune: bool) -> dict[str, Any]:
    """Init container: create this generation's directory for the pods' user; the scheduler's
    also removes older generations (cleanupOnStart), so a crashed writer's files never linger.

    The generation directory is given to the pods' user, with only the capabilities that
    takes: CHOWN (chown), FOWNER (chmod of a directory it no longer owns, on a restart),
    DAC_OVERRIDE (remove older generations, 0700 and owned by that user).
    """
    command = ["sh", "-c", _PREPARE, "prepare", CELL_MOUNT, str(cell.generation),
               f"{spec.run_as_user}:{spec.run_as_group}", "true" if prune else "false"]
    return root_task_container(spec, "prepare-segment", command,
                               ["CHOWN", "FOWNER", "DAC_OVERRIDE"],
                               [{"name": "cell", "mountPath": CELL_MOUNT}])


def _affinity(spec: TandemSpec, cell: Cell, component: str) -> dict[str, Any]:
    """Required node affinity pinning the cell to its chosen node (matchFields on the node
    name, as the DaemonSet controller does: hostname labels may differ from node names), plus
    the user's pod (anti-)affinity. Workers also require their cell's scheduler on the same
    host; with maxCellsPerNode 1, schedulers repel the other cells' schedulers."""
    user = copy.deepcopy(dict(spec.placement.affinity))
    affinity: dict[str, Any] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [cell.node]}]}]}}}
    for kind in ("podAffinity", "podAntiAffinity"):
        if kind in user:
            affinity[kind] = user[kind]
    if component == "worker":
        term = {"labelSelector": {"matchLabels": selector_labels(spec, "scheduler", cell.index)},
                "topologyKey": HOSTNAME}
        affinity.setdefault("podAffinity", {}).setdefault(
            "requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
    elif spec.placement.max_cells_per_node == 1:
        term = {"labelSelector": {"matchLabels": {INSTANCE_LABEL: spec.name,
                                                  COMPONENT_LABEL: "scheduler"},
                                  "matchExpressions": [{"key": CELL_LABEL, "operator": "NotIn",
                                                        "values": [str(cell.index)]}]},
                "topologyKey": HOSTNAME}
        affinity.setdefault("podAntiAffinity", {}).setdefault(
            "requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
    return affinity


def _model_volume(model: ModelSpec) -> list[dict[str, Any]]:
    """The model's volume, when it comes from one: the scheduler (tokenizer, chat template,
    image processor) and the workers (config, weights) read the same directory.

    A node's directory is hostPath type Directory, not DirectoryOrCreate: a missing model
    directory must keep the pods from starting (FailedMount on the pod), not hand them an
    empty one that fails later as "no config.json".
    """
    if model.claim_name:
        return [{"name": "model", "persistentVolumeClaim": {"claimName": model.claim_name,
                                                            "readOnly": True}}]
    if model.host_path:
        return [{"name": "model", "hostPath": {"path": model.host_path, "type": "Directory"}}]
    return []


def _model_mount(model: ModelSpec) -> dict[str, Any]:
    """Read-only at model.path, TANDEM_MODEL, in the scheduler and every worker alike."""
    mount: dict[str, Any] = {"name": "model", "mountPath": model.path, "readOnly": True}
    if model.sub_path:
        mount["subPath"] = model.sub_path
    return mount


def _volumes(spec: TandemSpec, cell: Cell, component: str) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [{"name": "cell", "hostPath": {
        "path": cell_dir(spec, cell.index), "type": "DirectoryOrCreate"}}, scratch_volume()]
    if component == "worker" and spec.shm_size:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory",
                                                     "sizeLimit": str(spec.shm_size)}})
    volumes += _model_volume(spec.model)
    if component == "scheduler":
        volumes += tls_volumes(spec)[0]
    return volumes


def _mounts(spec: TandemSpec, cell: Cell, component: str) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [{"name": "cell", "mountPath": SHM_MOUNT,
                                     "subPath": generation_dir(cell.generation)},
                                    dict(SCRATCH_MOUNT)]
    if component == "worker" and spec.shm_size:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if spec.model.mounted:
        mounts.append(_model_mount(spec.model))
    if component == "scheduler":
        mounts += tls_volumes(spec)[1]
    return mounts


def _container(spec: TandemSpec, cell: Cell, component: str) -> dict[str, Any]:
    """The scheduler or a worker. Both get TANDEM_HEALTH_LISTEN from the cell's ConfigMap
    and are probed there; only the scheduler exposes a gRPC port (workers are reached
    through their Unix sockets in the cell directory)."""
    if component == "scheduler":
        metrics, image = SCHEDULER_METRICS_PORT, spec.scheduler.image
        own = [{"name": "TANDEM_LISTEN", "value": f"0.0.0.0:{spec.scheduler.port}"}]
        resources = container_resources(spec.scheduler.resources, {"memory": cell.cache_bytes})
        user_env, ready = spec.scheduler.env, "tandem.v1.Generation"
    else:
        metrics, image = WORKER_METRICS_PORT, spec.worker.image
        own = [{"name": "TANDEM_WORKER_RANK", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}}]
        gpus = {spec.worker.gpu_resource: spec.worker.gpu_count} if spec.worker.gpu_count else {}
        resources = container_resources(spec.worker.resources, gpus)
        user_env, ready = spec.worker.env, ""
    own += [{"name": "TANDEM_METRICS_PORT", "value": str(metrics)},
            {"name": "OTEL_SERVICE_NAME", "value": f"tandem-{component}"}]
    return serving_container(spec, ServingContainer(
        role=component, image=image, config_map=child_name(spec, cell.index, "config"),
        resources=resources, mounts=_mounts(spec, cell, component), ready_service=ready,
        public_port=component == "scheduler", metrics_port=metrics, env=own, user_env=user_env,
        cell=cell.index))


def build_pod_template(spec: TandemSpec, cell: Cell, component: str) -> dict[str, Any]:
    """The pod of a cell's scheduler or worker; also what the operator dry-runs to learn
    whether Pod Security admission would let the StatefulSet create it."""
    pod_spec = serving_pod_spec(spec, component, [_container(spec, cell, component)],
                                _volumes(spec, cell, component))
    pod_spec["affinity"] = _affinity(spec, cell, component)
    pod_spec["initContainers"] = [_prepare_container(spec, cell, prune=(
        component == "scheduler" and spec.cache.cleanup_on_start))]
    if spec.placement.node_selector:
        pod_spec["nodeSelector"] = dict(spec.placement.node_selector)
    if spec.placement.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.placement.tolerations]
    pod_labels = labels(spec, component, cell.index)
    if component == "scheduler":
        pod_labels |= ENGINE_TYPE_LABELS
    return {
        "metadata": {
            "labels": pod_labels,
            "annotations": {CONFIG_HASH: config_hash(cell_config(spec, cell)),
                            GENERATION: str(cell.generation)},
        },
        "spec": pod_spec,
    }


def build_statefulset(spec: TandemSpec, cell: Cell, component: str) -> dict[str, Any]:
    """The scheduler (1 replica) or the workers (workersPerCell, started in parallel) of a
    cell. Its pod template carries the config hash, so a config change rolls the pods.

    Workers start in parallel because tensor-parallel ranks only turn Ready together (after
    their rendezvous); their governing Service (`<name>-workers`) gives each a DNS name.
    """
    workers = component == "worker"
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": child_name(spec, cell.index, "workers" if workers else "scheduler"),
                     "namespace": spec.namespace, "labels": labels(spec, component, cell.index),
                     "annotations": {NODE: cell.node, GENERATION: str(cell.generation)}},
        "spec": {
            "replicas": spec.worker.workers_per_cell if workers else 1,
            "serviceName": workers_service_name(spec) if workers else service_name(
                spec, headless=True),
            "podManagementPolicy": "Parallel" if workers else "OrderedReady",
            "selector": {"matchLabels": selector_labels(spec, component, cell.index)},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": build_pod_template(spec, cell, component),
        },
    }
