"""Pure builders for gateway and standalone routing (`spec.routing.mode`, docs/routing.md):
the Gateway API Inference Extension's InferencePools over the schedulers, and `tandem epp`,
the endpoint picker they name.

Gateway mode: the cluster's gateway (Istio, kgateway, Envoy Gateway, ...) carries the bytes;
an HTTPRoute or GRPCRoute sends them to a pool, and the gateway asks the pool's endpoint
picker (over Envoy's ext_proc) which cell takes each request. One pool per application
protocol, because a pool has one `appProtocol` for all its ports: h2c for `tandem.v1` gRPC,
HTTP/1.1 for the OpenAI API. Both pools name the one EPP Service; the EPP follows them
(`tandem epp --pool <name>-grpc --http-pool <name>-http`): its cells are the Ready pods the
pools select, so it never rolls when cells come, go or move. It watches with a
ServiceAccount of its own, whose Role may list and watch pods and InferencePools in the
namespace, nothing else.

Standalone mode (no such gateway in the cluster, so no pools; the default): the same EPP,
told the cells (every recorded cell, by its scheduler pod's DNS name, front.py: it rolls on
a change in the number of cells, never on placement), and an Envoy Deployment of the
operator's, configured by envoy.py's bootstrap builder; the Service moves to Envoy once it
is available.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from tandem_operator.containers import (
    HEALTH_PORT,
    SCRATCH_MOUNT,
    TERMINATION_MESSAGE_POLICY,
    ServingContainer,
    container_resources,
    container_security,
    scratch_volume,
    serving_container,
    serving_pod_spec,
)
from tandem_operator.envoy import EnvoyCell, ListenerTls, UpstreamTls, envoy_bootstrap
from tandem_operator.front import (
    build_front_deployment,
    build_settings_configmap,
    cell_address,
    cell_tls_config,
)
from tandem_operator.manifests import (
    CLIENT_CA_DIR,
    SCHEDULER_METRICS_PORT,
    TLS_DIR,
    labels,
    selector_labels,
    tls_config,
    tls_volumes,
    tracing_config,
)
from tandem_operator.placement import Cell
from tandem_operator.spec import TandemSpec

POOL_API = "inference.networking.k8s.io/v1"
EPP_PORT = 9002  # the ext_proc port; GIE's default for an endpoint picker Service
# The two application protocols of the cells: (pool name suffix, appProtocol).
GRPC_POOL, HTTP_POOL = ("grpc", "kubernetes.io/h2c"), ("http", "http")
ENVOY_DIR, ENVOY_FILE = "/etc/envoy", "envoy.json"  # Envoy reads JSON as YAML
ENVOY_ADMIN_PORT = 9901  # on the pod's loopback only: the admin API can stop Envoy
RBAC_API = "rbac.authorization.k8s.io/v1"
# What the EPP's Role grants: `tandem epp --pool` lists and watches, never gets or writes.
# The operator must hold these itself (Kubernetes lets it grant nothing more): the chart's
# RBAC has them, and tests/test_chart_rbac.py checks it.
EPP_RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
     "verbs": ["list", "watch"]},
]


def epp_name(spec: TandemSpec) -> str:
    return f"{spec.name}-epp"


def pool_name(spec: TandemSpec, protocol: str) -> str:
    """`<name>-grpc` (Generate) or `<name>-http` (the OpenAI API)."""
    return f"{spec.name}-{protocol}"


def pools(spec: TandemSpec) -> list[tuple[str, str, int]]:
    """(name, appProtocol, target port) of each pool: gRPC always, HTTP when it is served."""
    out = [(pool_name(spec, GRPC_POOL[0]), GRPC_POOL[1], spec.scheduler.port)]
    if spec.http.enabled:
        out.append((pool_name(spec, HTTP_POOL[0]), HTTP_POOL[1], spec.http.port))
    return out


def build_inference_pool(spec: TandemSpec, name: str, app_protocol: str,
                         port: int) -> dict[str, Any]:
    """One InferencePool over the schedulers' `port`, picked by the EPP."""
    return {
        "apiVersion": POOL_API,
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": spec.namespace,
                     "labels": labels(spec, "scheduler")},
        "spec": {
            "selector": {"matchLabels": selector_labels(spec, "scheduler")},
            "targetPorts": [{"number": port}],
            "appProtocol": app_protocol,
            "endpointPickerRef": {"group": "", "kind": "Service", "name": epp_name(spec),
                                  "port": {"number": EPP_PORT},
                                  "failureMode": spec.routing.failure_mode},
        },
    }


def epp_cells(spec: TandemSpec, cells: Sequence[Cell]) -> str:
    """TANDEM_EPP_CELLS: the cells' addresses (`host:grpc_port`), with `/http_port` when
    they serve HTTP."""
    suffix = f"/{spec.http.port}" if spec.http.enabled else ""
    return ",".join(cell_address(spec, c.index) + suffix for c in cells)


def epp_endpoints(spec: TandemSpec, cells: Sequence[Cell]) -> dict[str, str]:
    """Where the EPP finds its cells: the pools in gateway mode (the namespace is the pod's
    own), the recorded cells in standalone mode, which renders no pool."""
    if spec.routing.mode != "gateway":
        return {"TANDEM_EPP_CELLS": epp_cells(spec, cells)}
    found = {"TANDEM_EPP_POOL": pool_name(spec, GRPC_POOL[0])}
    if spec.http.enabled:
        found["TANDEM_EPP_HTTP_POOL"] = pool_name(spec, HTTP_POOL[0])
    return found


def epp_config(spec: TandemSpec, cells: Sequence[Cell]) -> dict[str, str]:
    """`tandem epp`'s TANDEM_* settings (docs/configuration.md): its cells' source, the
    picking settings (routing.loadFactor, the cells' block size), ext_proc on EPP_PORT (TLS
    with the service's certificate, as every public port), health on the plaintext health
    port."""
    return epp_endpoints(spec, cells) | {
        "TANDEM_LISTEN": f"0.0.0.0:{EPP_PORT}",
        "TANDEM_HEALTH_LISTEN": f"0.0.0.0:{HEALTH_PORT}",
        "TANDEM_METRICS_PORT": str(SCHEDULER_METRICS_PORT),
        "TANDEM_EPP_LOAD_FACTOR": str(spec.routing.load_factor),
        "TANDEM_BLOCK_SIZE": str(spec.block_size),
        "OTEL_SERVICE_NAME": "tandem-epp",
    } | tracing_config(spec) | tls_config(spec) | cell_tls_config(spec)


def build_epp_configmap(spec: TandemSpec, cells: Sequence[Cell]) -> dict[str, Any]:
    return build_settings_configmap(spec, epp_name(spec), "epp", epp_config(spec, cells))


def _epp_container(spec: TandemSpec) -> dict[str, Any]:
    """`tandem epp` in the scheduler's image, probed on its gRPC health services `liveness`
    and `readiness` (READY while at least one cell is)."""
    return serving_container(spec, ServingContainer(
        role="epp", image=spec.scheduler.image, config_map=epp_name(spec),
        resources=container_resources(spec.routing.epp.resources, {}),
        mounts=[SCRATCH_MOUNT, *tls_volumes(spec)[1]], ready_service="readiness",
        live_service="liveness", metrics_port=SCHEDULER_METRICS_PORT,
        own_ports=[{"name": "ext-proc", "containerPort": EPP_PORT, "protocol": "TCP"}]))


def build_epp_deployment(spec: TandemSpec, cells: Sequence[Cell]) -> dict[str, Any]:
    pod_spec = serving_pod_spec(spec, "epp", [_epp_container(spec)],
                                [scratch_volume(), *tls_volumes(spec)[0]])
    if spec.routing.mode == "gateway":  # it watches the pools with its own account
        pod_spec["serviceAccountName"] = epp_name(spec)
    return build_front_deployment(spec, epp_name(spec), "epp", spec.routing.epp.replicas,
                                  pod_spec, epp_config(spec, cells))


def build_epp_service(spec: TandemSpec) -> dict[str, Any]:
    """The Service the pools' endpointPickerRef names: ext_proc is gRPC (h2c, or TLS with
    the service's certificate)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": epp_name(spec), "namespace": spec.namespace,
                     "labels": labels(spec, "epp")},
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(spec, "epp"),
            "ports": [{"name": "ext-proc", "port": EPP_PORT, "targetPort": "ext-proc",
                       "protocol": "TCP",
                       "appProtocol": "https" if spec.tls.enabled else "kubernetes.io/h2c"}],
        },
    }


def _epp_metadata(spec: TandemSpec) -> dict[str, Any]:
    return {"name": epp_name(spec), "namespace": spec.namespace, "labels": labels(spec, "epp")}


def build_epp_service_account(spec: TandemSpec) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _epp_metadata(spec)}


def build_epp_role(spec: TandemSpec) -> dict[str, Any]:
    """List and watch pods and InferencePools in the service's namespace (EPP_RULES)."""
    return {"apiVersion": RBAC_API, "kind": "Role", "metadata": _epp_metadata(spec),
            "rules": EPP_RULES}


def build_epp_role_binding(spec: TandemSpec) -> dict[str, Any]:
    return {"apiVersion": RBAC_API, "kind": "RoleBinding", "metadata": _epp_metadata(spec),
            "roleRef": {"apiGroup": RBAC_API.split("/")[0], "kind": "Role",
                        "name": epp_name(spec)},
            "subjects": [{"kind": "ServiceAccount", "name": epp_name(spec),
                          "namespace": spec.namespace}]}


def envoy_name(spec: TandemSpec) -> str:
    return f"{spec.name}-envoy"


def envoy_cells(spec: TandemSpec, cells: Sequence[Cell]) -> list[EnvoyCell]:
    """The cells as Envoy reaches them: by their scheduler pods' DNS names (which resolve to
    the addresses the EPP names), named as the EPP names them (`x-tandem-cell`)."""
    return [EnvoyCell(address, address.rpartition(":")[0], spec.scheduler.port,
                      spec.http.port if spec.http.enabled else 0)
            for address in (cell_address(spec, c.index) for c in cells)]


def envoy_config(spec: TandemSpec, cells: Sequence[Cell]) -> dict[str, str]:
    """The Envoy of standalone routing: its bootstrap (envoy.py's builder) as a file.

    One listener per port of the Service, so that the Service's named ports (`grpc`, `http`)
    land on Envoy as they land on the schedulers. Envoy reaches the EPP through its Service.
    With `tls`, as every public port: the listeners serve the Secret's certificate (and ask
    for client certificates of the client CA), and Envoy reaches the EPP and the cells over
    TLS, trusting the Secret's CA and presenting its certificate when they ask for one. It
    knows every recorded cell (as the EPP does, so it rolls with the EPP on a change in
    their number): the EPP's pick, the fallbacks a failed request is retried on, and,
    fail-open, the round robin while the EPP is down.
    """
    epp = f"{epp_name(spec)}.{spec.namespace}.svc"
    ports = [spec.scheduler.port, *([spec.http.port] if spec.http.enabled else [])]
    listener_tls = epp_tls = cell_tls = None
    if spec.tls.enabled:
        mutual = bool(spec.tls.client_ca_secret_name)
        listener_tls = ListenerTls(f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key",
                                   f"{CLIENT_CA_DIR}/ca.crt" if mutual else "")
        cell_tls = UpstreamTls(ca=f"{TLS_DIR}/ca.crt",
                               cert=f"{TLS_DIR}/tls.crt" if mutual else "",
                               key=f"{TLS_DIR}/tls.key" if mutual else "")
        epp_tls = dataclasses.replace(cell_tls, sni=epp)
    bootstraps = [envoy_bootstrap(
        listen_port=port, epp_address=epp, epp_port=EPP_PORT, admin_port=ENVOY_ADMIN_PORT,
        listener_tls=listener_tls, epp_tls=epp_tls, cell_tls=cell_tls,
        failure_mode_allow=spec.routing.failure_mode == "FailOpen",
        cells=envoy_cells(spec, cells))
        for port in ports]
    bootstrap = bootstraps[0]
    for port, other in zip(ports[1:], bootstraps[1:], strict=True):
        [listener] = other["static_resources"]["listeners"]
        bootstrap["static_resources"]["listeners"].append(listener | {"name": f"tandem-{port}"})
    return {ENVOY_FILE: json.dumps(bootstrap, indent=1, sort_keys=True)}


def build_envoy_configmap(spec: TandemSpec, cells: Sequence[Cell]) -> dict[str, Any]:
    return build_settings_configmap(spec, envoy_name(spec), "envoy", envoy_config(spec, cells))


def _envoy_container(spec: TandemSpec) -> dict[str, Any]:
    """Envoy from its official image, as the pods' non-root user with a read-only root
    filesystem; probed on its listener (its admin port stays on the pod's loopback)."""
    ports = [{"name": "grpc", "containerPort": spec.scheduler.port, "protocol": "TCP"}]
    if spec.http.enabled:
        ports.append({"name": "http", "containerPort": spec.http.port, "protocol": "TCP"})
    probe = {"tcpSocket": {"port": "grpc"}, "timeoutSeconds": 5}
    return {
        "name": "envoy",
        "image": spec.routing.envoy_image,
        "imagePullPolicy": spec.pull_policy,
        "command": ["envoy", "-c", f"{ENVOY_DIR}/{ENVOY_FILE}", "--log-level", "warning"],
        "ports": ports,
        "resources": container_resources(spec.routing.envoy.resources, {}),
        "volumeMounts": [SCRATCH_MOUNT, {"name": "envoy", "mountPath": ENVOY_DIR,
                                         "readOnly": True}, *tls_volumes(spec)[1]],
        "securityContext": container_security(),
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
        "readinessProbe": probe | {"periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": probe | {"periodSeconds": 10, "failureThreshold": 6},
    }


def build_envoy_deployment(spec: TandemSpec, cells: Sequence[Cell]) -> dict[str, Any]:
    volumes = [scratch_volume(), {"name": "envoy", "configMap": {"name": envoy_name(spec)}},
               *tls_volumes(spec)[0]]
    pod_spec = serving_pod_spec(spec, "envoy", [_envoy_container(spec)], volumes)
    return build_front_deployment(spec, envoy_name(spec), "envoy", spec.routing.envoy.replicas,
                                  pod_spec, envoy_config(spec, cells))
