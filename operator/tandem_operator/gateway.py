"""Pure builders for gateway and standalone routing (`spec.routing.mode`, docs/routing.md):
the Gateway API Inference Extension's InferencePools over the schedulers, and `tandem epp`,
the endpoint picker they name.

Gateway mode: the cluster's gateway (Istio, kgateway, Envoy Gateway, ...) carries the bytes;
an HTTPRoute or GRPCRoute sends them to a pool, and the gateway asks the pool's endpoint
picker (over Envoy's ext_proc) which cell takes each request. One pool per application
protocol, because a pool has one `appProtocol` for all its ports: h2c for `tandem.v1` gRPC,
HTTP/1.1 for the OpenAI API. Both pools name the one EPP Service; the EPP knows the cells as
the router does (every recorded cell, by its scheduler pod's DNS name), so it rolls on a
change in the number of cells, never on placement.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem_operator.containers import (
    HEALTH_PORT,
    SCRATCH_MOUNT,
    ServingContainer,
    container_resources,
    scratch_volume,
    serving_container,
    serving_pod_spec,
)
from tandem_operator.manifests import (
    SCHEDULER_METRICS_PORT,
    labels,
    selector_labels,
    tls_config,
    tls_volumes,
    tracing_config,
)
from tandem_operator.placement import Cell
from tandem_operator.router import (
    build_front_deployment,
    build_settings_configmap,
    cell_address,
    cell_tls_config,
)
from tandem_operator.spec import TandemSpec

POOL_API = "inference.networking.k8s.io/v1"
EPP_PORT = 9002  # the ext_proc port; GIE's default for an endpoint picker Service
# The two application protocols of the cells: (pool name suffix, appProtocol).
GRPC_POOL, HTTP_POOL = ("grpc", "kubernetes.io/h2c"), ("http", "http")


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
    """TANDEM_EPP_CELLS: `host:grpc_port`, with `/http_port` when the cells serve HTTP."""
    suffix = f"/{spec.http.port}" if spec.http.enabled else ""
    return ",".join(cell_address(spec, c.index) + suffix for c in cells)


def epp_config(spec: TandemSpec, cells: Sequence[Cell]) -> dict[str, str]:
    """`tandem epp`'s TANDEM_* settings (docs/configuration.md): the router's picking
    settings under the router's names, ext_proc on EPP_PORT (TLS with the service's
    certificate, as every public port), health on the plaintext health port."""
    data = {
        "TANDEM_EPP_CELLS": epp_cells(spec, cells),
        "TANDEM_LISTEN": f"0.0.0.0:{EPP_PORT}",
        "TANDEM_HEALTH_LISTEN": f"0.0.0.0:{HEALTH_PORT}",
        "TANDEM_METRICS_PORT": str(SCHEDULER_METRICS_PORT),
        "TANDEM_ROUTER_LOAD_FACTOR": str(spec.router.load_factor),
        "TANDEM_BLOCK_SIZE": str(spec.block_size),
        "OTEL_SERVICE_NAME": "tandem-epp",
    }
    if spec.http.enabled:
        data["TANDEM_EPP_HTTP_PORT"] = str(spec.http.port)
    return data | tracing_config(spec) | tls_config(spec) | cell_tls_config(spec)


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
