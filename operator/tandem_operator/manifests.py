"""Pure builders for a TandemService's children other than the workloads: names, labels, the
per-cell config, the Services and the cleanup Job. No API calls, no globals: the handlers
adopt what these return and apply it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tandem_operator.containers import HEALTH_PORT, pull_secrets, root_task_container
from tandem_operator.placement import INSTANCE_LABEL, MANAGED_BY, Cell
from tandem_operator.spec import TandemSpec

SHM_MOUNT = "/var/run/tandem"
CELL_MOUNT = "/var/run/tandem-cell"
SCHEDULER_METRICS_PORT = 9400
WORKER_METRICS_PORT = 9401
TP_PORT = 29500  # the tensor-parallel rendezvous, served by worker 0 of a cell
TLS_DIR = "/etc/tandem/tls"  # the spec.tls.secretName Secret
CLIENT_CA_DIR = "/etc/tandem/client-ca"  # the spec.tls.clientCASecretName Secret
CONFIG_HASH = "tandem.dev/config-hash"
GENERATION = "tandem.dev/segment-generation"
NODE = "tandem.dev/node"  # on StatefulSets: the node their cell was placed on
CELL_LABEL = "tandem.dev/cell"
COMPONENT_LABEL = "app.kubernetes.io/component"
# On the schedulers' pods: which metric names an endpoint picker of the Gateway API Inference
# Extension (and llm-d's, which renamed the key) reads. The schedulers export the model-server
# protocol's gauges under vLLM's names (tandem.metrics), so the value names that dialect; it is
# also what a picker assumes without the label.
ENGINE_TYPE_LABELS = {"inference.networking.k8s.io/engine-type": "vllm",
                      "llm-d.ai/engine-type": "vllm"}


def child_name(spec: TandemSpec, cell: int, role: str) -> str:
    """`<name>-<cell>-<role>`; names are capped (spec.MAX_NAME_LENGTH) so that StatefulSet
    names stay <= 52."""
    return f"{spec.name}-{cell}-{role}"


def service_name(spec: TandemSpec, headless: bool = False) -> str:
    return f"{spec.name}-headless" if headless else spec.name


def workers_service_name(spec: TandemSpec) -> str:
    """The headless Service governing the worker StatefulSets: stable pod DNS names."""
    return f"{spec.name}-workers"


def pod_dns(spec: TandemSpec, pod: str, service: str) -> str:
    """A StatefulSet pod's own DNS name through the headless Service that governs it."""
    return f"{pod}.{service}.{spec.namespace}.svc"


def endpoint(spec: TandemSpec) -> str:
    """The gRPC target clients use for Generate (balanced by the ClusterIP Service)."""
    return f"dns:///{service_name(spec)}.{spec.namespace}.svc:{spec.scheduler.port}"


def selector_labels(spec: TandemSpec, component: str, cell: int | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "tandem", INSTANCE_LABEL: spec.name,
              COMPONENT_LABEL: component}
    if cell is not None:
        labels[CELL_LABEL] = str(cell)
    return labels


def labels(spec: TandemSpec, component: str, cell: int | None = None) -> dict[str, str]:
    return {**selector_labels(spec, component, cell), MANAGED_BY[0]: MANAGED_BY[1]}


def scale_selector(spec: TandemSpec) -> str:
    """`status.selector` for the scale subresource: the schedulers, one per cell."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(spec, "scheduler").items())


def cell_dir(spec: TandemSpec, cell: int) -> str:
    """Host directory of a cell; its generations are subdirectories `gen-<n>`."""
    return f"{spec.cache.host_root}/{spec.namespace}.{spec.name}.{cell}"


def generation_dir(generation: int) -> str:
    return f"gen-{generation}"


def segment_path(spec: TandemSpec, cell: Cell) -> str:
    return f"{cell_dir(spec, cell.index)}/{generation_dir(cell.generation)}"


def cell_config(spec: TandemSpec, cell: Cell) -> dict[str, str]:
    """The TANDEM_* settings a cell's scheduler and workers share (docs/configuration.md).

    Settings that differ between the two (listen address, metrics port, rank, service name)
    are set on the containers instead; each component ignores the settings of the other.
    """
    workers = spec.worker.workers_per_cell
    data = {
        "TANDEM_SHM_DIR": SHM_MOUNT,
        "TANDEM_MODEL": spec.model.setting,
        "TANDEM_MM_CACHE": spec.cache.type,
        "TANDEM_MM_CACHE_SIZE": str(cell.cache_bytes),
        "TANDEM_MM_CACHE_MAX_OBJECT_SIZE": str(spec.cache.max_object_size),
        "TANDEM_ENABLE_PREFIX_CACHING": "true" if spec.prefix_caching else "false",
        "TANDEM_BLOCK_SIZE": str(spec.block_size),
        "TANDEM_WORKERS": str(workers),
        "TANDEM_WORKER_ADDRESSES": ",".join(
            f"unix://{SHM_MOUNT}/worker-{rank}.sock" for rank in range(workers)),
        "TANDEM_DEVICE": spec.worker.device,
        "TANDEM_HEALTH_LISTEN": f"0.0.0.0:{HEALTH_PORT}",
        **tensor_parallel_config(spec, cell.index),
        **tls_config(spec),
        **http_config(spec),
        **served_names_config(spec),
    }
    return data | tracing_config(spec)


def served_names_config(spec: TandemSpec) -> dict[str, str]:
    """TANDEM_SERVED_MODEL_NAME of the schedulers (workers ignore it), when the spec names
    the model; empty otherwise, so such cells' hash stays as it was."""
    names = spec.model.served_names
    return {"TANDEM_SERVED_MODEL_NAME": ",".join(names)} if names else {}


def http_config(spec: TandemSpec) -> dict[str, str]:
    """TANDEM_HTTP_LISTEN of the schedulers (workers ignore it); empty when
    the HTTP API is off, so such cells' hash stays as it was."""
    return {"TANDEM_HTTP_LISTEN": f"0.0.0.0:{spec.http.port}"} if spec.http.enabled else {}


def tracing_config(spec: TandemSpec) -> dict[str, str]:
    """The OTLP exporter settings, when the spec names a collector."""
    if not spec.tracing.endpoint:
        return {}
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": spec.tracing.endpoint,
            "OTEL_TRACES_SAMPLER": spec.tracing.sampler,
            "OTEL_TRACES_SAMPLER_ARG": spec.tracing.ratio}


def tls_config(spec: TandemSpec) -> dict[str, str]:
    """TANDEM_TLS_* of the public port: files of the Secrets `tls_volumes` mounts. In the
    config (not on the container) so that turning TLS on or off rolls the cells one at a
    time; workers ignore these keys. Empty without TLS, so such cells' hash stays as it was.
    """
    if not spec.tls.enabled:
        return {}
    data = {"TANDEM_TLS_CERT": f"{TLS_DIR}/tls.crt", "TANDEM_TLS_KEY": f"{TLS_DIR}/tls.key"}
    if spec.tls.client_ca_secret_name:
        data["TANDEM_TLS_CLIENT_CA"] = f"{CLIENT_CA_DIR}/ca.crt"
    return data


def tls_volumes(spec: TandemSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The TLS Secrets as read-only volumes, and their mounts (scheduler and endpoint picker).

    Mode 0444: the pods' user reads them without an fsGroup (which would re-own every
    volume of the pod, the model's claim included) and nothing in the pod can write them.
    """
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for name, secret, path in (("tls", spec.tls.secret_name, TLS_DIR),
                               ("client-ca", spec.tls.client_ca_secret_name, CLIENT_CA_DIR)):
        if secret:
            volumes.append({"name": name, "secret": {"secretName": secret,
                                                     "defaultMode": 0o444}})
            mounts.append({"name": name, "mountPath": path, "readOnly": True})
    return volumes, mounts


def tensor_parallel_config(spec: TandemSpec, cell: int) -> dict[str, str]:
    """Where a cell's workers meet for tensor parallelism: worker 0 by its stable DNS name.

    Empty without tensor parallelism, so such cells' config (and hash) stays as it was.
    """
    tp = spec.worker.tensor_parallel_size
    if tp == 1:
        return {}
    master = pod_dns(spec, f"{child_name(spec, cell, 'workers')}-0", workers_service_name(spec))
    return {"TANDEM_TENSOR_PARALLEL_SIZE": str(tp), "TANDEM_TP_MASTER_ADDR": master,
            "TANDEM_TP_MASTER_PORT": str(TP_PORT)}


def config_hash(data: dict[str, str]) -> str:
    """Content hash of a cell's config; on the pod templates, so a config change rolls pods."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def build_configmap(spec: TandemSpec, cell: Cell) -> dict[str, Any]:
    data = cell_config(spec, cell)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": child_name(spec, cell.index, "config"), "namespace": spec.namespace,
                     "labels": labels(spec, "config", cell.index),
                     "annotations": {CONFIG_HASH: config_hash(data)}},
        "data": data,
    }


def build_service(spec: TandemSpec, headless: bool = False, front: str = "scheduler",
                  ) -> dict[str, Any]:
    """Generate for clients: across all cells' schedulers, or through the `front` component
    (Envoy: the caller names it once it is available; its pods name their ports `grpc` and
    `http` too). The headless twin always lists the scheduler pods: clients that balance on
    their own (gRPC `round_robin` over `dns:///<name>-headless`), the endpoint picker and
    fail-open Envoy reach the cells through it."""
    target = "scheduler" if headless else front
    svc_spec: dict[str, Any] = {
        "selector": selector_labels(spec, target),
        "ports": [{"name": "grpc", "port": spec.scheduler.port, "targetPort": "grpc",
                   "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"}],
    }
    if spec.http.enabled:
        svc_spec["ports"].append({"name": "http", "port": spec.http.port, "targetPort": "http",
                                  "protocol": "TCP",
                                  "appProtocol": "https" if spec.tls.enabled else "http"})
    if headless:
        svc_spec["clusterIP"] = "None"
    else:
        svc_spec["type"] = "ClusterIP"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service_name(spec, headless), "namespace": spec.namespace,
                     "labels": labels(spec, "scheduler")},
        "spec": svc_spec,
    }


def build_workers_service(spec: TandemSpec) -> dict[str, Any]:
    """Headless Service of every cell's workers: each worker pod gets a DNS name, published
    before it is Ready (a worker turns Ready only after the rendezvous it is needed for)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": workers_service_name(spec), "namespace": spec.namespace,
                     "labels": labels(spec, "worker")},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(spec, "worker"),
            "ports": [{"name": "rendezvous", "port": TP_PORT, "targetPort": TP_PORT,
                       "protocol": "TCP"}],
        },
    }


def build_cleanup_job(spec: TandemSpec, cell: int, node: str, generation: int | None = None,
                      ) -> dict[str, Any]:
    """A Job on `node` that removes a cell's directory, or one old generation of it.

    Owner references cannot remove host files, so deletion and re-placement run this. It is
    pinned with nodeName (no scheduling, so it runs even on a full node) and tolerates every
    taint; a dead node makes it fail by activeDeadlineSeconds, which the operator accepts.
    """
    target = cell_dir(spec, cell).removeprefix(spec.cache.host_root).lstrip("/")
    role = "cleanup"
    if generation is not None:
        target, role = f"{target}/{generation_dir(generation)}", f"cleanup-g{generation}"
    meta_labels = labels(spec, "cleanup", cell)
    # DAC_OVERRIDE: the cell directory holds the pods' user's 0700 generations. The Job's pod
    # has no pod-level security context, hence seccomp on the container.
    container = root_task_container(spec, "cleanup", ["rm", "-rf", "--", f"/host/{target}"],
                                    ["DAC_OVERRIDE"], [{"name": "root", "mountPath": "/host"}])
    container["securityContext"]["seccompProfile"] = {"type": "RuntimeDefault"}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": child_name(spec, cell, role), "namespace": spec.namespace,
                     "labels": meta_labels},
        "spec": {
            "backoffLimit": 2,
            "activeDeadlineSeconds": 300,
            "ttlSecondsAfterFinished": 600,
            "template": {
                "metadata": {"labels": meta_labels},
                "spec": {
                    "nodeName": node,
                    "restartPolicy": "Never",
                    "tolerations": [{"operator": "Exists"}],
                    "imagePullSecrets": pull_secrets(spec),
                    "containers": [container],
                    "volumes": [{"name": "root", "hostPath": {
                        "path": spec.cache.host_root, "type": "DirectoryOrCreate"}}],
                },
            },
        },
    }
