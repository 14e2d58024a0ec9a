"""Pure builders for what every Tandem pod shares, so the scheduler, worker and endpoint
picker containers (workloads.py, gateway.py) and the root tasks on a node's segment directory (the
prepare-segment init container, the cleanup Job) are each written once.

A serving container (`tandem <role>`) reads its TANDEM_* settings from one ConfigMap, runs as
the pods' non-root user with a read-only root filesystem, writes only to its volumes and the
/tmp scratch emptyDir (also its HOME), and is probed over gRPC on the plaintext health-only
port; `ServingContainer` holds what differs between the three.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.shutdown import STOP_MARGIN_S
from tandem_operator.placement import resource_amount
from tandem_operator.spec import Resources, TandemSpec

HEALTH_PORT = 50061  # every pod's plaintext health-only port (kubelet probes)
SCRATCH_DIR = "/tmp"  # the containers' only writable path besides their volumes
SCRATCH_MOUNT = {"name": "tmp", "mountPath": SCRATCH_DIR}
SCRATCH_ENV = {"name": "HOME", "value": SCRATCH_DIR}  # the image sets it too; another may not
# A container that exits with an error gets the tail of its log as its termination message:
# the one-line start-up error (a model that cannot be loaded, a bad certificate) then shows
# in the pod's lastState and, through conditions.pod_problem, in the TandemService's status.
TERMINATION_MESSAGE_POLICY = "FallbackToLogsOnError"
# A root task on the segment directory is a few file operations: small, fixed resources.
TASK_RESOURCES = {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}}


@dataclass(frozen=True)
class ServingContainer:
    """What one serving container adds to the shape they all share (`serving_container`).

    Lists are complete and in order, except that HOME and the resource attributes go between
    `env` and `user_env`, and the health port after the public one.
    """

    role: str  # scheduler | worker | epp: the container's name and `tandem <role>`
    image: str
    config_map: str  # the ConfigMap of its TANDEM_* settings (envFrom)
    resources: Mapping[str, Any]  # requests and limits, as container_resources() builds them
    mounts: Sequence[Mapping[str, Any]]  # every volume mount, SCRATCH_MOUNT included
    ready_service: str  # grpc.health.v1 service its readiness asks for ("" = overall)
    live_service: str = ""  # the service its startup and liveness probes ask for
    public_port: bool = False  # serves Generate on spec.scheduler.port (the scheduler)
    metrics_port: int | None = None  # its Prometheus port, when it has one
    own_ports: Sequence[Mapping[str, Any]] = ()  # ports of its own (the EPP's ext_proc)
    env: Sequence[Mapping[str, Any]] = ()  # its own variables
    user_env: Sequence[tuple[str, str]] = ()  # the spec's (name, value) pairs, last
    cell: int | None = None  # its cell, in OTEL_RESOURCE_ATTRIBUTES


def _grpc_probe(port: int, service: str, period: int, failures: int) -> dict[str, Any]:
    return {"grpc": {"port": port, "service": service}, "periodSeconds": period,
            "timeoutSeconds": 5, "failureThreshold": failures}


def probes(spec: TandemSpec, ready_service: str, live_service: str = "") -> dict[str, Any]:
    """Native gRPC probes on grpc.health.v1 at the health-only port (kubelet probes speak no
    TLS, and must not need the worker's unauthenticated Step API on the network).

    Liveness is lenient (6 x 10 s on the server's overall health, "") so one slow reply never
    kills a pod; readiness asks for the real dependency (`tandem.v1.Generation` is SERVING
    only once the scheduler's workers are attached); startup allows a long model load.
    """
    return {
        "startupProbe": _grpc_probe(HEALTH_PORT, live_service, 5,
                                    spec.startup_failure_threshold),
        "readinessProbe": _grpc_probe(HEALTH_PORT, ready_service, 5, 3),
        "livenessProbe": _grpc_probe(HEALTH_PORT, live_service, 10, 6),
    }


def container_resources(res: Resources, extra: Mapping[str, int]) -> dict[str, Any]:
    """Requests and limits with `extra` added: bytes of memory, or counts of a device."""
    requests, limits = dict(res.requests), dict(res.limits)
    for name, amount in extra.items():
        if name == "memory":
            requests["memory"] = str(resource_amount("memory", requests.get("memory", 0)) + amount)
            if "memory" in limits:
                limits["memory"] = str(resource_amount("memory", limits["memory"]) + amount)
        else:  # extended resources (GPUs) must have requests == limits
            requests[name] = limits[name] = str(amount)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def container_security() -> dict[str, Any]:
    """Every serving container: a non-root user, no capabilities, no privilege escalation, the
    runtime's seccomp profile, and a read-only root filesystem. What they write goes to their
    volumes: the cell directory, /dev/shm (workers) and the scratch emptyDir at /tmp."""
    return {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


def scratch_volume() -> dict[str, Any]:
    """/tmp for temporary files and for HOME (`SCRATCH_ENV`): torch, CUDA and Triton keep
    their caches under ~, and the image's user has no home. Disk-backed, counted as the pod's
    ephemeral storage."""
    return {"name": "tmp", "emptyDir": {}}


def resource_env(spec: TandemSpec, cell: int | None = None) -> list[dict[str, Any]]:
    """OTEL_RESOURCE_ATTRIBUTES of a container: its pod and node come from the Downward API,
    so they are container env (``$(VAR)`` expands only there), not config."""
    attributes = (f"k8s.namespace.name={spec.namespace},k8s.pod.name=$(K8S_POD_NAME),"
                  f"k8s.node.name=$(K8S_NODE_NAME),tandem.service={spec.name}")
    if cell is not None:
        attributes += f",tandem.cell={cell}"
    return [
        {"name": "K8S_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "K8S_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": attributes},
    ]


def shutdown_grace(spec: TandemSpec, role: str) -> float:
    """TANDEM_SHUTDOWN_GRACE of a serving container: the spec's grace; a worker's is longer
    by the stop margin. Stopping a cell stops its scheduler and workers together, in no set
    order (their StatefulSets are separate): a worker serves its scheduler's steps while the
    scheduler streams to it (worker_svc.server.shutdown), and must not give up before the
    scheduler's grace and its last step are over."""
    return spec.shutdown_grace + (STOP_MARGIN_S if role == "worker" else 0.0)


def termination_grace(spec: TandemSpec, role: str) -> int:
    """terminationGracePeriodSeconds of a serving pod: its process's grace plus the margin
    to stop in order (engine, channels, segment, traces) before the kubelet kills it."""
    return math.ceil(shutdown_grace(spec, role) + STOP_MARGIN_S)


def serving_container(spec: TandemSpec, c: ServingContainer) -> dict[str, Any]:
    """The scheduler, a worker or the endpoint picker container."""
    ports = [{"name": "grpc", "containerPort": spec.scheduler.port, "protocol": "TCP"}
             ] if c.public_port else []
    if c.public_port and spec.http.enabled:
        ports.append({"name": "http", "containerPort": spec.http.port, "protocol": "TCP"})
    ports.extend(dict(p) for p in c.own_ports)
    ports.append({"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"})
    if c.metrics_port is not None:
        ports.append({"name": "metrics", "containerPort": c.metrics_port, "protocol": "TCP"})
    return {
        "name": c.role,
        "image": c.image,
        "imagePullPolicy": spec.pull_policy,
        "command": ["tandem", c.role],
        "ports": ports,
        "envFrom": [{"configMapRef": {"name": c.config_map}}],
        "env": [*c.env, {"name": "TANDEM_SHUTDOWN_GRACE",
                         "value": f"{shutdown_grace(spec, c.role):g}"},
                dict(SCRATCH_ENV), *resource_env(spec, c.cell),
                *({"name": k, "value": v} for k, v in c.user_env)],
        "resources": dict(c.resources),
        "volumeMounts": [dict(m) for m in c.mounts],
        "securityContext": container_security(),
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
        **probes(spec, c.ready_service, c.live_service),
    }


def pull_secrets(spec: TandemSpec) -> list[dict[str, str]]:
    return [{"name": s} for s in spec.pull_secrets]


def serving_pod_spec(spec: TandemSpec, role: str, containers: list[dict[str, Any]],
                     volumes: list[dict[str, Any]]) -> dict[str, Any]:
    """The pod of serving containers of `role`: the pods' user and group with seccomp
    RuntimeDefault, no service-link variables (a Service named `tandem` would inject
    TANDEM_PORT and the like among the TANDEM_* settings), the grace `termination_grace`."""
    pod: dict[str, Any] = {
        "securityContext": {"runAsUser": spec.run_as_user, "runAsGroup": spec.run_as_group,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace(spec, role),
        "containers": containers,
        "volumes": volumes,
    }
    if spec.pull_secrets:
        pod["imagePullSecrets"] = pull_secrets(spec)
    return pod


def root_task_container(spec: TandemSpec, name: str, command: list[str],
                        capabilities: list[str], mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """A short task on a node's segment directory, in the scheduler's image: root, because
    kubelet creates hostPath directories root-owned 0755 and the pods' generations are 0700
    and the pods' user's; with all capabilities dropped but `capabilities`."""
    return {
        "name": name,
        "image": spec.scheduler.image,
        "imagePullPolicy": spec.pull_policy,
        "command": command,
        "securityContext": {"runAsUser": 0, "runAsNonRoot": False,
                            "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"], "add": capabilities}},
        "resources": {k: dict(v) for k, v in TASK_RESOURCES.items()},
        "volumeMounts": mounts,
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
    }
