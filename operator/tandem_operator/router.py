"""Pure builders for the router in front of a TandemService's cells (when `spec.routed`).

The router (`tandem router`) is stateless apart from its in-flight counts, so it is a
Deployment, not part of any cell. It reaches each cell's scheduler by the scheduler pod's
stable DNS name, and lists every cell the operator records, placed or not: a cell that is not
serving is skipped by the router's own health checks (and its keys move), so placement changes
never restart the router; a change in the number of cells changes its ConfigMap, whose hash on
the pod template rolls it (surge first, so one replica always serves).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    CONFIG_HASH,
    TLS_DIR,
    child_name,
    config_hash,
    http_config,
    labels,
    pod_dns,
    selector_labels,
    service_name,
    tls_config,
    tls_volumes,
    tracing_config,
)
from tandem_operator.placement import Cell
from tandem_operator.spec import TandemSpec

READY_SERVICE = "tandem.v1.Generation"  # SERVING while at least one cell is


def router_name(spec: TandemSpec) -> str:
    return f"{spec.name}-router"


def cell_address(spec: TandemSpec, index: int) -> str:
    """`host:port` of cell `index`'s scheduler: its pod through the headless Service."""
    pod = f"{child_name(spec, index, 'scheduler')}-0"
    return f"{pod_dns(spec, pod, service_name(spec, headless=True))}:{spec.scheduler.port}"


def router_config(spec: TandemSpec, cells: Sequence[Cell]) -> dict[str, str]:
    """The router's TANDEM_* settings (docs/configuration.md); the block size is the cells'
    so that a text prompt's routing key covers exactly the first block they cache."""
    return {
        "TANDEM_ROUTER_CELLS": ",".join(cell_address(spec, c.index) for c in cells),
        "TANDEM_LISTEN": f"0.0.0.0:{spec.scheduler.port}",
        "TANDEM_HEALTH_LISTEN": f"0.0.0.0:{HEALTH_PORT}",
        "TANDEM_ROUTER_LOAD_FACTOR": str(spec.router.load_factor),
        "TANDEM_BLOCK_SIZE": str(spec.block_size),
        "OTEL_SERVICE_NAME": "tandem-router",
    } | tracing_config(spec) | tls_config(spec) | cell_tls_config(spec) | http_config(spec)


def cell_tls_config(spec: TandemSpec, prefix: str = "ROUTER") -> dict[str, str]:
    """How the router (or, with `prefix` EPP, the endpoint picker: they share these flags
    under their own TANDEM_<prefix>_* names) reaches TLS cells: it trusts the CA of their
    certificate (the Secret's `ca.crt`) and, when they ask for client certificates, presents
    that same certificate (the cells' client CA must have signed it)."""
    if not spec.tls.enabled:
        return {}
    data = {f"TANDEM_{prefix}_CELL_TLS_CA": f"{TLS_DIR}/ca.crt"}
    if spec.tls.client_ca_secret_name:
        data |= {f"TANDEM_{prefix}_CELL_TLS_CERT": f"{TLS_DIR}/tls.crt",
                 f"TANDEM_{prefix}_CELL_TLS_KEY": f"{TLS_DIR}/tls.key"}
    return data


def build_router_configmap(spec: TandemSpec, cells: Sequence[Cell]) -> dict[str, Any]:
    return build_settings_configmap(spec, router_name(spec), "router", router_config(spec, cells))


def build_settings_configmap(spec: TandemSpec, name: str, component: str,
                             data: dict[str, str]) -> dict[str, Any]:
    """The TANDEM_* settings of a Deployment in front of the cells (router, EPP)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": spec.namespace,
                     "labels": labels(spec, component),
                     "annotations": {CONFIG_HASH: config_hash(data)}},
        "data": data,
    }


def _container(spec: TandemSpec) -> dict[str, Any]:
    """`tandem router`, in the scheduler's image: its settings, OTEL_SERVICE_NAME included,
    are in its ConfigMap; it has no metrics port."""
    return serving_container(spec, ServingContainer(
        role="router", image=spec.scheduler.image, config_map=router_name(spec),
        resources=container_resources(spec.router.resources, {}),
        mounts=[SCRATCH_MOUNT, *tls_volumes(spec)[1]], ready_service=READY_SERVICE,
        public_port=True))


def build_router_deployment(spec: TandemSpec, cells: Sequence[Cell]) -> dict[str, Any]:
    pod_spec = serving_pod_spec(spec, "router", [_container(spec)],
                                [scratch_volume(), *tls_volumes(spec)[0]])
    return build_front_deployment(spec, router_name(spec), "router", spec.router.replicas,
                                  pod_spec, router_config(spec, cells))


def build_front_deployment(spec: TandemSpec, name: str, component: str, replicas: int,
                           pod_spec: dict[str, Any], config: dict[str, str]) -> dict[str, Any]:
    """A stateless Deployment in front of the cells (router, EPP, Envoy): surge first, so
    one replica always serves; the hash of its `config` on the pod template rolls it when
    the config changes."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": spec.namespace,
                     "labels": labels(spec, component)},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(spec, component)},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels(spec, component), "annotations": {
                    CONFIG_HASH: config_hash(config)}},
                "spec": pod_spec,
            },
        },
    }


def front_available(deployment: Mapping[str, Any] | None) -> bool:
    """Whether a pod of a front Deployment (router, Envoy) is Ready to take the Service's
    traffic (during a roll the old replicas still count: surge-first keeps one available)."""
    status = (deployment or {}).get("status") or {}
    return int(status.get("availableReplicas") or 0) > 0
