"""Pure builders shared by what runs in front of a TandemService's cells (the endpoint picker
and standalone routing's Envoy, gateway.py): how they name and reach the cells, their
settings ConfigMap, and their Deployment.

They list every cell the operator records, placed or not, by the scheduler pod's stable DNS
name: a cell that is not serving is skipped by the picker's own health checks (and its keys
move), so placement changes never restart them; a change in the number of cells changes the
ConfigMap, whose hash on the pod template rolls the Deployment (surge first, so one replica
always serves).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem_operator.manifests import (
    CONFIG_HASH,
    TLS_DIR,
    child_name,
    config_hash,
    labels,
    pod_dns,
    selector_labels,
    service_name,
)
from tandem_operator.spec import TandemSpec

# The Deployment and ConfigMap of `tandem router`, which earlier operator versions ran in
# front of the cells: deleted wherever one is left (reconcile.py).
LEGACY_ROUTER_SUFFIX = "-router"


def cell_address(spec: TandemSpec, index: int) -> str:
    """`host:port` of cell `index`'s scheduler: its pod through the headless Service."""
    pod = f"{child_name(spec, index, 'scheduler')}-0"
    return f"{pod_dns(spec, pod, service_name(spec, headless=True))}:{spec.scheduler.port}"


def cell_tls_config(spec: TandemSpec) -> dict[str, str]:
    """How the endpoint picker reaches TLS cells: it trusts the CA of their certificate (the
    Secret's `ca.crt`) and, when they ask for client certificates, presents that same
    certificate (the cells' client CA must have signed it)."""
    if not spec.tls.enabled:
        return {}
    data = {"TANDEM_EPP_CELL_TLS_CA": f"{TLS_DIR}/ca.crt"}
    if spec.tls.client_ca_secret_name:
        data |= {"TANDEM_EPP_CELL_TLS_CERT": f"{TLS_DIR}/tls.crt",
                 "TANDEM_EPP_CELL_TLS_KEY": f"{TLS_DIR}/tls.key"}
    return data


def build_settings_configmap(spec: TandemSpec, name: str, component: str,
                             data: dict[str, str]) -> dict[str, Any]:
    """The settings of a Deployment in front of the cells (EPP, Envoy)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": spec.namespace,
                     "labels": labels(spec, component),
                     "annotations": {CONFIG_HASH: config_hash(data)}},
        "data": data,
    }


def build_front_deployment(spec: TandemSpec, name: str, component: str, replicas: int,
                           pod_spec: dict[str, Any], config: dict[str, str]) -> dict[str, Any]:
    """A stateless Deployment in front of the cells (EPP, Envoy): surge first, so one
    replica always serves; the hash of its `config` on the pod template rolls it when the
    config changes."""
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
    """Whether a pod of a front Deployment (Envoy) is Ready to take the Service's traffic
    (during a roll the old replicas still count: surge-first keeps one available)."""
    status = (deployment or {}).get("status") or {}
    return int(status.get("availableReplicas") or 0) > 0
