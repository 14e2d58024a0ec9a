"""Observed cell state and condition folding, from pod-index values."""

from __future__ import annotations

from kube_emulator.fixtures import tandem_spec

from tandem_operator.conditions import (
    PodInfo,
    fold_verdicts,
    invalid_spec_conditions,
    observe_cell,
    pod_info,
    ready_verdict,
    render_conditions,
)
from tandem_operator.placement import Cell

GI = 1 << 30
SPEC = tandem_spec({"cells": 2, "worker": {"workersPerCell": 2}})
CELLS = [Cell(0, "a", 4 * GI, 4 * GI, 1), Cell(1, "b", 2 * GI, 4 * GI, 1)]


def pods(cell: int, node: str, config: str = "h", ready: bool = True) -> list[PodInfo]:
    return [PodInfo(f"s{cell}", "scheduler", cell, node, ready, config, False),
            PodInfo(f"w{cell}-0", "worker", cell, node, ready, config, False),
            PodInfo(f"w{cell}-1", "worker", cell, node, ready, config, False)]


def test_pod_info_reads_labels_readiness_and_config() -> None:
    body = {"metadata": {"name": "p", "labels": {"tandem.dev/cell": "1",
                                                 "app.kubernetes.io/component": "worker"},
                         "annotations": {"tandem.dev/config-hash": "abc"}},
            "spec": {"nodeName": "a"},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert pod_info(body) == PodInfo("p", "worker", 1, "a", True, "abc", False)
    body["metadata"]["labels"]["app.kubernetes.io/component"] = "cleanup"
    assert pod_info(body) is None


def test_observe_counts_only_ready_pods_on_the_current_config() -> None:
    obs = observe_cell(SPEC, CELLS[0], "h", pods(0, "a")[:2] + pods(0, "a", config="old")[2:])
    assert obs.scheduler_ready and obs.workers_ready == 1 and not obs.ready
    assert observe_cell(SPEC, CELLS[0], "h", pods(0, "a")).ready


def test_observe_finds_pods_off_the_cells_node() -> None:
    stray = PodInfo("w0-1", "worker", 0, "b", True, "h", False)
    obs = observe_cell(SPEC, CELLS[0], "h", [*pods(0, "a")[:2], stray])
    assert obs.misplaced == (stray,)
    unscheduled = PodInfo("w0-1", "worker", 0, "", False, "h", False)
    assert observe_cell(SPEC, CELLS[0], "h", [unscheduled]).misplaced == ()


def test_all_ready_folds_to_ready_and_reports_a_reduced_cache() -> None:
    obs = {c.index: observe_cell(SPEC, c, "h", pods(c.index, c.node)) for c in CELLS}
    verdicts = fold_verdicts(SPEC, CELLS, obs, {})
    assert {k: v[0] for k, v in verdicts.items()} == dict.fromkeys(verdicts, "True")
    assert verdicts["CacheReady"][1] == "SizeReduced"
    assert "cell 1: 2Gi" in verdicts["CacheReady"][2]
    assert ready_verdict(verdicts) == ("True", "Ready", "cell 0 on a, cell 1 on b")


def test_ready_takes_the_first_false_condition() -> None:
    unplaced = [CELLS[0], Cell(1, "", 0, 4 * GI, 0, "0/2 nodes fit: a: full")]
    obs = {0: observe_cell(SPEC, CELLS[0], "h", pods(0, "a", ready=False))}
    verdicts = fold_verdicts(SPEC, unplaced, obs, {})
    assert verdicts["SchedulerReady"][0] == "False"
    status, reason, message = ready_verdict(verdicts)
    assert (status, reason) == ("False", "NoFittingNode")
    assert message == "cell 1: 0/2 nodes fit: a: full"
    placed = fold_verdicts(SPEC, CELLS, obs, {})
    assert ready_verdict(placed) == (
        "False", "SchedulersNotReady", "0/2 schedulers ready on the current config; waiting "
        "for StatefulSet demo-0-scheduler, StatefulSet demo-1-scheduler")
    assert verdicts["WorkersReady"][2] == (
        "0/4 workers ready on the current config; waiting for StatefulSet demo-0-workers (0/2 "
        "ready), StatefulSet demo-1-workers (0/2 ready, cell not placed)")


def test_pod_security_rejection_is_a_placement_failure() -> None:
    verdicts = fold_verdicts(SPEC, CELLS, {}, {1: 'violates PodSecurity "baseline:latest"'})
    assert verdicts["PlacementReady"][:2] == ("False", "PodSecurityRejected")
    assert ready_verdict(verdicts)[1] == "PodSecurityRejected"


def test_misplaced_pods_make_colocated_false() -> None:
    stray = PodInfo("w0-1", "worker", 0, "b", True, "h", False)
    obs = {0: observe_cell(SPEC, CELLS[0], "h", [*pods(0, "a")[:2], stray])}
    verdicts = fold_verdicts(SPEC, CELLS[:1], obs, {})
    assert verdicts["Colocated"] == (
        "False", "NotColocated",
        "worker pod w0-1 of cell 0 runs on b, not on the cell's node a: the operator re-places "
        "the cell")


def test_transition_time_moves_only_when_the_status_changes() -> None:
    verdicts = fold_verdicts(SPEC, CELLS, {}, {})
    first = render_conditions(verdicts, [], "T1", 3)
    assert first[0]["type"] == "Ready"
    again = render_conditions(verdicts, first, "T2", 4)
    assert all(c["lastTransitionTime"] == "T1" and c["observedGeneration"] == 4 for c in again)
    obs = {c.index: observe_cell(SPEC, c, "h", pods(c.index, c.node)) for c in CELLS}
    flipped = {c["type"]: c for c in render_conditions(
        fold_verdicts(SPEC, CELLS, obs, {}), again, "T3", 4)}
    assert flipped["SchedulerReady"]["lastTransitionTime"] == "T3"
    assert flipped["PlacementReady"]["lastTransitionTime"] == "T1"


def test_invalid_spec_conditions() -> None:
    conditions = {c["type"]: c for c in invalid_spec_conditions("bad", [], "T", 2)}
    assert conditions["Ready"]["status"] == "False"
    assert conditions["Ready"]["reason"] == "InvalidSpec"
    assert conditions["PlacementReady"]["status"] == "False"
    assert conditions["CacheReady"]["status"] == "Unknown"
