"""The pieces of the handler layer that need no cluster: kopf settings, the operator's
environment knobs, the CLI entry point's defaults, the roll order and the per-object state."""

from __future__ import annotations

import kopf
import pytest
from kube_emulator.fixtures import tandem_spec

from tandem_operator.conditions import PodInfo
from tandem_operator.handlers import OperatorConfig, changed_status, configure
from tandem_operator.main import parser
from tandem_operator.manifests import cell_config, config_hash
from tandem_operator.placement import Cell
from tandem_operator.reconcile import (
    ServiceState,
    cells_from_status,
    retry_delay,
    roll_blocker,
    wait_delay,
)

GI = 1 << 30


def test_kopf_settings_live_under_tandem_dev_and_bound_watches() -> None:
    settings = kopf.OperatorSettings()
    configure(settings)
    assert settings.persistence.finalizer == "tandem.dev/finalizer"
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert settings.watching.server_timeout == 300
    assert settings.watching.client_timeout is not None
    assert settings.watching.client_timeout > settings.watching.server_timeout
    assert settings.peering.standalone
    peered = kopf.OperatorSettings()
    peered.peering.name = "tandem"
    configure(peered)
    assert not peered.peering.standalone


def test_operator_config_from_env() -> None:
    assert OperatorConfig.from_env({}) == OperatorConfig(10.0, 600.0)
    assert OperatorConfig.from_env({"TANDEM_OPERATOR_RESYNC_SECONDS": "2",
                                    "TANDEM_OPERATOR_CLEANUP_TIMEOUT_SECONDS": "30"}) == (
        OperatorConfig(2.0, 30.0))


def test_entry_point_defaults() -> None:
    args = parser().parse_args([])
    assert args.namespace == [] and args.peering is None
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    assert parser().parse_args(["-n", "a", "-n", "b"]).namespace == ["a", "b"]


def test_unchanged_status_is_not_rewritten() -> None:
    status = {"replicas": 1, "conditions": [{"type": "Ready"}]}
    assert changed_status(status, {"replicas": 1, "conditions": [{"type": "Ready"}]}) == {}
    assert changed_status(status, {"replicas": 2, "endpoint": "e"}) == {"replicas": 2,
                                                                        "endpoint": "e"}


def test_cells_roll_one_at_a_time() -> None:
    spec = tandem_spec({"cells": 2})
    cells = [Cell(0, "a", 2 * GI, 2 * GI, 2), Cell(1, "b", 2 * GI, 2 * GI, 2)]
    new = [config_hash(cell_config(spec, c)) for c in cells]

    def pods(cell: int, config: str, ready: bool = True) -> list[PodInfo]:
        return [PodInfo(f"s{cell}", "scheduler", cell, "ab"[cell], ready, config, False),
                PodInfo(f"w{cell}", "worker", cell, "ab"[cell], ready, config, False)]
    old = pods(0, "old") + pods(1, "old")
    assert roll_blocker(spec, cells, 0, old) == ""
    assert "waits for cell 0" in roll_blocker(spec, cells, 1, old)
    assert "waits for cell 0" in roll_blocker(spec, cells, 1, pods(0, new[0], False) + old[2:])
    assert roll_blocker(spec, cells, 1, pods(0, new[0]) + old[2:]) == ""
    assert roll_blocker(spec, cells, 1, pods(0, "old")) == ""  # no pods yet: a first start


def test_state_from_status_and_its_invariants() -> None:
    status = {"cells": [
        {"index": 1, "nodeName": "", "segmentBytes": 0, "requestedBytes": 4,
         "segmentGeneration": 0},
        {"index": 0, "nodeName": "a", "segmentBytes": 4, "requestedBytes": 4,
         "segmentGeneration": 3}]}
    state = ServiceState(cells_from_status(status))
    state.check_invariants()
    assert [(c.index, c.node, c.generation) for c in state.cells] == [(0, "a", 3), (1, "", 0)]
    state.rejected[5] = "x"
    with pytest.raises(AssertionError):
        state.check_invariants()


def test_retry_delay_backs_off_to_five_minutes() -> None:
    assert [retry_delay(r) for r in (0, 1, 2, 10)] == [5, 10, 20, 300]


def test_waits_for_the_operators_own_work_back_off_to_thirty_seconds() -> None:
    """A roll or cleanup wait posts an Event per retry: a few quick ones, then at most 2/min."""
    assert [wait_delay(r) for r in range(8)] == [2, 2, 2, 4, 8, 16, 30, 30]
