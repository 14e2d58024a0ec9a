"""Node choice and cache sizing, without a cluster: the operator's index values in, cells out."""

from __future__ import annotations

import pytest
from kube_emulator.fixtures import node, pod, tandem_spec

from tandem_operator.placement import (
    Cell,
    NodeInfo,
    cell_requests,
    node_info,
    place_cells,
    pod_load,
    pod_requests,
)

GI = 1 << 30


def nodes(*bodies: dict) -> dict[str, NodeInfo]:
    return {b["metadata"]["name"]: node_info(b) for b in bodies}


def placed(cells: list[Cell]) -> list[str]:
    for c in cells:
        c.check_invariants()
    return [c.node for c in cells]


def test_node_info_parses_allocatable_readiness_and_cordon() -> None:
    info = node_info(node("a", cpu="1500m", memory="8Gi", gpus=2))
    assert info.allocatable == {"cpu": 1500, "memory": 8 * GI, "nvidia.com/gpu": 2, "pods": 110}
    assert info.schedulable
    assert not node_info(node("b", ready=False)).schedulable
    cordoned = node("c")
    cordoned["spec"]["unschedulable"] = True
    assert not node_info(cordoned).schedulable


def test_pod_requests_count_init_containers_as_kube_scheduler_does() -> None:
    spec = {"containers": [{"resources": {"requests": {"cpu": "250m", "memory": "1Gi"}}},
                           {"resources": {"requests": {"memory": "1Gi"}}}],
            "initContainers": [{"resources": {"requests": {"cpu": "2", "memory": "1Mi"}}}]}
    assert pod_requests(spec) == {"cpu": 2000, "memory": 2 * GI}


def test_pod_load_owner_and_finished_pods() -> None:
    theirs = pod_load(pod("x", "a", {"memory": "1Gi"}))
    assert theirs is not None and theirs.owner == "" and theirs.requests == {"memory": GI}
    ours = pod("y", "a", {}, labels={"app.kubernetes.io/managed-by": "tandem-operator",
                                     "app.kubernetes.io/instance": "demo"}, namespace="serving")
    assert pod_load(ours).owner == "serving/demo"  # type: ignore[union-attr]
    done = pod("z", "a", {"memory": "1Gi"})
    done["status"]["phase"] = "Succeeded"
    assert pod_load(done) is None
    assert pod_load(pod("w", "", {"memory": "1Gi"})) is None  # unscheduled


def test_cell_requests_add_the_workers_and_their_gpus() -> None:
    spec = tandem_spec({"worker": {"workersPerCell": 2, "gpu": {"count": 2}}})
    need = cell_requests(spec)
    assert need["nvidia.com/gpu"] == 4
    assert need["memory"] == 1 * GI + 2 * 4 * GI  # scheduler + 2 workers, defaults
    assert need["cpu"] == 3000


def test_two_cells_go_to_two_nodes_with_the_full_cache() -> None:
    spec = tandem_spec({"cells": 2})
    cells = place_cells(spec, nodes(node("a"), node("b")), [], [])
    assert sorted(placed(cells)) == ["a", "b"]
    assert all(c.cache_bytes == 4 * GI and c.generation == 1 for c in cells)


def test_cache_is_capped_by_the_node_memory_fraction_minus_requests() -> None:
    spec = tandem_spec({"featureCache": {"size": "32Gi", "maxNodeMemoryPercent": 50}})
    other = pod_load(pod("db", "a", {"memory": "10Gi"}))
    assert other is not None
    [cell] = place_cells(spec, nodes(node("a", memory="64Gi")), [other], [])
    # 50% of 64Gi, minus 10Gi of another pod, minus the cell's own 1Gi + 4Gi requests
    assert cell.cache_bytes == 32 * GI - 10 * GI - 5 * GI
    assert cell.requested_bytes == 32 * GI


def test_no_fitting_node_says_why_for_each_node() -> None:
    spec = tandem_spec({"worker": {"gpu": {"count": 16}}})
    [cell] = place_cells(spec, nodes(node("a", gpus=8), node("b", ready=False)), [], [])
    assert cell.node == "" and cell.generation == 0
    assert cell.reason.startswith("0/2 nodes fit")
    assert "a: needs 16 nvidia.com/gpu, 8 free" in cell.reason
    assert "b: not Ready or cordoned" in cell.reason


def test_memory_already_requested_by_other_pods_blocks_a_node() -> None:
    spec = tandem_spec({})
    hog = pod_load(pod("hog", "a", {"memory": "60Gi"}))
    assert hog is not None
    [cell] = place_cells(spec, nodes(node("a")), [hog], [])
    assert "needs 5Gi memory, 4Gi free" in cell.reason


def test_no_memory_for_the_cache_is_a_misfit() -> None:
    spec = tandem_spec({"featureCache": {"maxNodeMemoryPercent": 5}})
    [cell] = place_cells(spec, nodes(node("a", memory="64Gi")), [], [])
    assert cell.node == "" and "no memory left for the cache" in cell.reason


@pytest.mark.parametrize(("tolerations", "fits"), [
    ([], False),
    ([{"key": "gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"}], True),
    ([{"key": "gpu", "operator": "Equal", "value": "false"}], False),
    ([{"key": "gpu", "operator": "Exists"}], True),
    ([{"operator": "Exists"}], True),
    ([{"key": "gpu", "operator": "Exists", "effect": "NoExecute"}], False),
])
def test_taints_must_be_tolerated(tolerations: list[dict], fits: bool) -> None:
    spec = tandem_spec({"placement": {"tolerations": tolerations}})
    tainted = node("a", taints=[{"key": "gpu", "value": "true", "effect": "NoSchedule"}])
    [cell] = place_cells(spec, nodes(tainted), [], [])
    assert (cell.node == "a") == fits
    if not fits:
        assert "taint gpu=true:NoSchedule not tolerated" in cell.reason


def test_prefer_no_schedule_taints_do_not_block() -> None:
    soft = node("a", taints=[{"key": "x", "value": "", "effect": "PreferNoSchedule"}])
    assert placed(place_cells(tandem_spec({}), nodes(soft), [], [])) == ["a"]


def test_max_cells_per_node() -> None:
    one = place_cells(tandem_spec({"cells": 2}), nodes(node("a")), [], [])
    assert placed(one)[0] == "a" and one[1].node == ""
    assert "maxCellsPerNode=1 reached" in one[1].reason
    two = place_cells(tandem_spec({"cells": 2, "placement": {"maxCellsPerNode": 2},
                                   "featureCache": {"size": "1Gi"}}), nodes(node("a")), [], [])
    assert placed(two) == ["a", "a"]


def test_second_cell_on_a_node_sees_the_first_cells_gpus() -> None:
    spec = tandem_spec({"cells": 2, "placement": {"maxCellsPerNode": 2},
                        "worker": {"gpu": {"count": 3}}})
    cells = place_cells(spec, nodes(node("a", gpus=4)), [], [])
    assert cells[0].node == "a" and "needs 3 nvidia.com/gpu, 1 free" in cells[1].reason


def test_node_selector_and_required_node_affinity() -> None:
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "gpu-memory", "operator": "Gt", "values": ["40"]}]}]}}}
    spec = tandem_spec({"placement": {"nodeSelector": {"pool": "serving"}, "affinity": affinity}})
    pool = {"pool": "serving"}
    candidates = nodes(node("small", labels={**pool, "gpu-memory": "24"}),
                       node("big", labels={**pool, "gpu-memory": "80"}),
                       node("elsewhere", labels={"gpu-memory": "80"}))
    [cell] = place_cells(spec, candidates, [], [])
    assert cell.node == "big"
    [lost] = place_cells(spec, {k: v for k, v in candidates.items() if k != "big"}, [], [])
    assert "small: required node affinity does not match" in lost.reason
    assert "elsewhere: node selector does not match" in lost.reason


def test_largest_cache_wins_then_fewest_spare_gpus() -> None:
    spec = tandem_spec({"featureCache": {"size": "16Gi"}})
    [roomy] = place_cells(spec, nodes(node("small", memory="32Gi"), node("large")), [], [])
    assert roomy.node == "large"
    [packed] = place_cells(tandem_spec({}), nodes(node("a", gpus=8), node("b", gpus=2)), [], [])
    assert packed.node == "b"


def test_a_placed_cell_stays_put_across_restarts_and_new_pods() -> None:
    spec = tandem_spec({"cells": 2})
    first = place_cells(spec, nodes(node("a"), node("b")), [], [])
    newcomer = pod_load(pod("new", first[0].node, {"memory": "20Gi"}))
    assert newcomer is not None
    again = place_cells(spec, nodes(node("a"), node("b")), [newcomer], first)
    assert again == first


def test_a_new_size_keeps_the_node_and_bumps_the_generation() -> None:
    cells = place_cells(tandem_spec({"cells": 2}), nodes(node("a"), node("b")), [], [])
    resized = place_cells(tandem_spec({"cells": 2, "featureCache": {"size": "2Gi"}}),
                          nodes(node("a"), node("b")), [], cells)
    assert [c.node for c in resized] == [c.node for c in cells]
    assert [c.generation for c in resized] == [2, 2]
    assert all(c.cache_bytes == 2 * GI for c in resized)


def test_lost_node_and_forced_repair_re_place_with_a_new_generation() -> None:
    spec = tandem_spec({"cells": 2})
    cells = place_cells(spec, nodes(node("a"), node("b"), node("c")), [], [])
    gone = cells[0].node
    left = nodes(*[node(n) for n in "abc" if n != gone])
    moved = place_cells(spec, left, [], cells)
    assert moved[0].node not in (gone, cells[1].node) and moved[0].generation == 2
    assert moved[1] == cells[1]
    forced = place_cells(spec, left, [], moved, force=frozenset({1}))
    assert forced[1].node == moved[1].node and forced[1].generation == 2  # same node preferred


def test_scale_down_drops_the_extra_cells() -> None:
    cells = place_cells(tandem_spec({"cells": 2}), nodes(node("a"), node("b")), [], [])
    assert place_cells(tandem_spec({"cells": 1}), nodes(node("a"), node("b")), [], cells) == [
        cells[0]]


def test_cache_off_needs_no_memory_budget() -> None:
    spec = tandem_spec({"featureCache": {"type": "none", "maxNodeMemoryPercent": 1}})
    [cell] = place_cells(spec, nodes(node("a")), [], [])
    assert cell.node == "a" and cell.cache_bytes == 0 and cell.requested_bytes == 0
