"""What runs in front of the cells (operator/tandem_operator/front.py, gateway.py): the
endpoint picker's list of cells, when it rolls, where the user-facing Service points, and how
a spec written for the removed `tandem router` is read.

Strict schema validation of these objects is in test_operator_manifests.py with the others.
"""

from __future__ import annotations

from typing import Any

from kube_emulator.fixtures import tandem_spec

from tandem_operator.front import cell_address, front_available
from tandem_operator.gateway import build_epp_configmap, build_epp_deployment
from tandem_operator.manifests import build_service
from tandem_operator.placement import Cell
from tandem_operator.reconcile import Front

GI = 1 << 30
CELLS = [Cell(0, "n-a", GI, GI, 1), Cell(1, "n-b", GI, GI, 3), Cell(2, "", 0, GI, 0, "no")]


def spec3(patch: dict[str, Any] | None = None):
    return tandem_spec({"cells": 3, "tracing": {"endpoint": "otel:4317"}, **(patch or {})})


def test_the_picker_lists_every_recorded_cell_by_its_schedulers_dns_name() -> None:
    spec = spec3({"routing": {"loadFactor": 2}})
    cm = build_epp_configmap(spec, CELLS)
    assert cm["metadata"]["name"] == "demo-epp"
    assert cm["data"]["TANDEM_EPP_CELLS"] == ",".join(
        f"demo-{i}-scheduler-0.demo-headless.serving.svc:50051/8000" for i in range(3))
    assert cell_address(spec, 2) == "demo-2-scheduler-0.demo-headless.serving.svc:50051"
    assert cm["data"]["TANDEM_EPP_LOAD_FACTOR"] == "2.0"
    assert cm["data"]["TANDEM_BLOCK_SIZE"] == "16"
    assert cm["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "otel:4317"
    assert build_epp_configmap(spec3(), CELLS)["data"]["TANDEM_EPP_LOAD_FACTOR"] == "1.25"


def test_the_picker_rolls_when_the_cells_change_not_when_they_move() -> None:
    spec = spec3()
    key = "tandem.dev/config-hash"

    def pod_hash(cells: list[Cell]) -> str:
        return str(build_epp_deployment(spec, cells)["spec"]["template"]["metadata"][
            "annotations"][key])
    moved = [Cell(0, "n-c", 2 * GI, GI, 2), *CELLS[1:]]
    assert pod_hash(moved) == pod_hash(CELLS)
    assert pod_hash(CELLS[:2]) != pod_hash(CELLS)
    assert pod_hash(CELLS) == build_epp_configmap(spec, CELLS)["metadata"]["annotations"][key]


def test_the_service_points_at_the_front_it_is_given() -> None:
    spec = spec3()
    component = "app.kubernetes.io/component"
    assert build_service(spec)["spec"]["selector"][component] == "scheduler"
    fronted = build_service(spec, front="envoy")
    assert fronted["spec"]["selector"][component] == "envoy"
    assert fronted["spec"]["ports"][0]["targetPort"] == "grpc"
    headless = build_service(spec, headless=True, front="envoy")
    assert headless["spec"]["selector"][component] == "scheduler", "the picker's way in"


def test_front_availability_comes_from_the_deployment_status() -> None:
    assert not front_available(None)
    assert not front_available({"status": {}})
    assert not front_available({"status": {"availableReplicas": 0, "replicas": 1}})
    assert front_available({"status": {"availableReplicas": 1}})


def test_standalone_is_the_default_and_one_cell_needs_no_front() -> None:
    cells = CELLS[:2]
    assert spec3().routing.mode == "standalone"
    assert Front.wanted(spec3(), cells) == Front("envoy", (0, 1))
    assert Front.wanted(tandem_spec({"cells": 1}), cells[:1]) == Front("scheduler", ())


def test_a_spec_for_the_removed_router_runs_standalone_and_is_warned_about() -> None:
    """Existing TandemServices keep validating and serving: `routing.mode: router` renders
    exactly as standalone, and it and spec.router each get a deprecation message."""
    old = spec3({"routing": {"mode": "router"},
                 "router": {"enabled": True, "replicas": 2, "loadFactor": 1.5}})
    new = spec3({"routing": {"mode": "standalone"}})
    assert old.routing == new.routing and old.front == new.front == "envoy"
    assert build_epp_configmap(old, CELLS) == build_epp_configmap(new, CELLS)
    mode, router = old.deprecations
    assert "routing.mode router is deprecated" in mode and "set routing.mode standalone" in mode
    assert "spec.router is ignored" in router and "routing.loadFactor" in router
    assert new.deprecations == ()
