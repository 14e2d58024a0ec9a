"""The router's manifests (operator/tandem_operator/router.py) and where the user-facing
Service points.

Strict schema validation of these objects is in test_operator_manifests.py with the others.
"""

from __future__ import annotations

from typing import Any

from kube_emulator.fixtures import tandem_spec

from tandem_operator.manifests import build_service
from tandem_operator.placement import Cell
from tandem_operator.reconcile import Front
from tandem_operator.router import (
    build_router_configmap,
    build_router_deployment,
    cell_address,
    front_available,
)

GI = 1 << 30
CELLS = [Cell(0, "n-a", GI, GI, 1), Cell(1, "n-b", GI, GI, 3), Cell(2, "", 0, GI, 0, "no")]


def spec3(patch: dict[str, Any] | None = None):
    return tandem_spec({"cells": 3, "tracing": {"endpoint": "otel:4317"}, **(patch or {})})


def cm_of(spec: Any) -> dict[str, str]:
    data: dict[str, str] = build_router_configmap(spec, CELLS)["data"]
    return data


def test_the_router_lists_every_recorded_cell_by_its_schedulers_dns_name() -> None:
    spec = spec3()
    cm = build_router_configmap(spec, CELLS)
    assert cm["metadata"]["name"] == "demo-router"
    assert cm["data"]["TANDEM_ROUTER_CELLS"] == ",".join(
        f"demo-{i}-scheduler-0.demo-headless.serving.svc:50051" for i in range(3))
    assert cell_address(spec, 2) == "demo-2-scheduler-0.demo-headless.serving.svc:50051"
    assert cm["data"]["TANDEM_LISTEN"] == "0.0.0.0:50051"
    assert cm["data"]["TANDEM_ROUTER_LOAD_FACTOR"] == "1.25"
    assert cm["data"]["TANDEM_BLOCK_SIZE"] == "16"
    assert cm["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "otel:4317"


def test_router_deployment_runs_tandem_router_and_is_probed() -> None:
    spec = spec3({"router": {"replicas": 2, "loadFactor": 2},
                  "image": {"pullSecrets": ["ghcr"]}})
    dep = build_router_deployment(spec, CELLS)
    assert dep["kind"] == "Deployment" and dep["metadata"]["name"] == "demo-router"
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    pod = dep["spec"]["template"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    [c] = pod["spec"]["containers"]
    assert c["command"] == ["tandem", "router"]
    assert c["image"] == "ghcr.io/tandem-dev/tandem:0.1.0"
    assert c["envFrom"] == [{"configMapRef": {"name": "demo-router"}}]
    assert c["ports"] == [{"name": "grpc", "containerPort": 50051, "protocol": "TCP"},
                          {"name": "http", "containerPort": 8000, "protocol": "TCP"},
                          {"name": "health", "containerPort": 50061, "protocol": "TCP"}]
    assert c["readinessProbe"]["grpc"] == {"port": 50061, "service": "tandem.v1.Generation"}
    assert cm_of(spec)["TANDEM_HEALTH_LISTEN"] == "0.0.0.0:50061", "health only, plaintext"
    assert c["resources"] == {"requests": {"cpu": "250m", "memory": "256Mi"},
                              "limits": {"memory": "512Mi"}}
    assert pod["spec"]["imagePullSecrets"] == [{"name": "ghcr"}]
    assert "affinity" not in pod["spec"], "runs anywhere"
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["tmp"], "no node-bound volume"
    cm = build_router_configmap(spec, CELLS)
    assert cm["data"]["TANDEM_ROUTER_LOAD_FACTOR"] == "2.0"


def test_the_router_rolls_when_the_cells_change_not_when_they_move() -> None:
    spec = spec3()
    key = "tandem.dev/config-hash"

    def pod_hash(cells: list[Cell]) -> str:
        return str(build_router_deployment(spec, cells)["spec"]["template"]["metadata"][
            "annotations"][key])
    moved = [Cell(0, "n-c", 2 * GI, GI, 2), *CELLS[1:]]
    assert pod_hash(moved) == pod_hash(CELLS)
    assert pod_hash(CELLS[:2]) != pod_hash(CELLS)
    assert pod_hash(CELLS) == build_router_configmap(spec, CELLS)["metadata"]["annotations"][key]


def test_the_service_points_at_the_router_only_when_routed() -> None:
    spec = spec3()
    component = "app.kubernetes.io/component"
    assert build_service(spec)["spec"]["selector"][component] == "scheduler"
    routed = build_service(spec, front="router")
    assert routed["spec"]["selector"][component] == "router"
    assert routed["spec"]["ports"][0]["targetPort"] == "grpc"
    headless = build_service(spec, headless=True, front="router")
    assert headless["spec"]["selector"][component] == "scheduler", "the router's way in"


def test_router_availability_comes_from_the_deployment_status() -> None:
    assert not front_available(None)
    assert not front_available({"status": {}})
    assert not front_available({"status": {"availableReplicas": 0, "replicas": 1}})
    assert front_available({"status": {"availableReplicas": 1}})


def test_the_front_the_operator_converges_to() -> None:
    cells = CELLS[:2]
    assert Front.wanted(spec3(), cells) == Front("router", (0, 1))
    assert Front.wanted(tandem_spec({"cells": 1}), cells[:1]) == Front("scheduler", ())
    assert Front.wanted(spec3({"router": {"enabled": False}}), cells) == Front("scheduler", ())


def test_a_tls_router_serves_with_the_secret_and_presents_it_to_mutual_tls_cells() -> None:
    spec = spec3({"tls": {"secretName": "demo-tls", "clientCASecretName": "tenants-ca"}})
    data = cm_of(spec)
    assert data["TANDEM_TLS_CERT"] == "/etc/tandem/tls/tls.crt"
    assert data["TANDEM_TLS_KEY"] == "/etc/tandem/tls/tls.key"
    assert data["TANDEM_TLS_CLIENT_CA"] == "/etc/tandem/client-ca/ca.crt"
    assert data["TANDEM_ROUTER_CELL_TLS_CA"] == "/etc/tandem/tls/ca.crt"
    assert data["TANDEM_ROUTER_CELL_TLS_CERT"] == "/etc/tandem/tls/tls.crt"
    assert data["TANDEM_ROUTER_CELL_TLS_KEY"] == "/etc/tandem/tls/tls.key"
    pod = build_router_deployment(spec, CELLS)["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["tmp", "tls", "client-ca"]
    [c] = pod["containers"]
    assert {"name": "tls", "mountPath": "/etc/tandem/tls", "readOnly": True} in c["volumeMounts"]
    server_only = cm_of(spec3({"tls": {"secretName": "demo-tls"}}))
    assert "TANDEM_ROUTER_CELL_TLS_CERT" not in server_only
    assert "TANDEM_TLS_CLIENT_CA" not in server_only
    assert not any("TLS" in k for k in cm_of(spec3()))
