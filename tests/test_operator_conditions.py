"""Observed cell state and condition folding, from pod-index values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kube_emulator.fixtures import tandem_spec

from tandem_operator.conditions import (
    PROBLEM_CHARS,
    PodInfo,
    fold_verdicts,
    invalid_spec_conditions,
    observe_cell,
    pod_info,
    pod_problem,
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


# --- pods that do not come up ---------------------------------------------------------------
MODEL_ERROR = ("tandem worker: error: /models/q/config.json: key 'model_type' is 'foo'; "
               "Tandem serves llama, qwen2, qwen2_vl, qwen2_5_vl")


def pod_body(name: str, component: str, cell: int = 0, containers: list[dict] | None = None,
             init: list[dict] | None = None, conditions: list[dict] | None = None) -> dict:
    """A cell pod as the apiserver reports it, with kubelet's container statuses."""
    status: dict = {"conditions": conditions or [{"type": "Ready", "status": "False"}]}
    if containers is not None:
        status["containerStatuses"] = containers
    if init is not None:
        status["initContainerStatuses"] = init
    return {"metadata": {"name": name, "labels": {"tandem.dev/cell": str(cell),
                                                  "app.kubernetes.io/component": component},
                         "annotations": {"tandem.dev/config-hash": "h"}},
            "spec": {"nodeName": "a"}, "status": status}


def crash_looping(name: str, message: str, reason: str = "Error", code: int = 1) -> dict:
    """kubelet's status of a container between restarts (CrashLoopBackOff)."""
    return {"name": name, "ready": False, "restartCount": 4,
            "state": {"waiting": {"reason": "CrashLoopBackOff",
                                  "message": f"back-off 1m20s restarting failed container={name}"}},
            "lastState": {"terminated": {"exitCode": code, "reason": reason, "message": message}}}


def test_a_crash_looping_worker_shows_its_last_log_line() -> None:
    log_tail = "2026-01-01 worker_svc.server INFO worker 0 listening\n" + MODEL_ERROR + "\n"
    body = pod_body("demo-0-workers-0", "worker", containers=[crash_looping("worker", log_tail)])
    assert pod_info(body).problem == f"is crash-looping: {MODEL_ERROR} (Error, exit code 1)"


def test_a_traceback_shows_its_exception_line() -> None:
    """A process that dies with a traceback still has its error last."""
    tail = ('Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
            "tandem.errors.InvalidInput: /models/q/model.safetensors: key 'lm_head.weight' "
            "is missing\n")
    body = pod_body("p", "worker", containers=[crash_looping("worker", tail)])
    assert pod_problem(body) == ("is crash-looping: tandem.errors.InvalidInput: "
                                 "/models/q/model.safetensors: key 'lm_head.weight' is missing "
                                 "(Error, exit code 1)")


def test_problems_without_a_message_and_the_other_container_states() -> None:
    oom = crash_looping("worker", "", reason="OOMKilled", code=137)
    assert pod_problem(pod_body("p", "worker", containers=[oom])) == (
        "is crash-looping: OOMKilled, exit code 137")
    running_again = {**crash_looping("worker", MODEL_ERROR), "state": {"running": {}}}
    assert pod_problem(pod_body("p", "worker", containers=[running_again])) == (
        f"failed: {MODEL_ERROR} (Error, exit code 1)")
    recovered = {**running_again, "ready": True}
    assert pod_problem(pod_body("p", "worker", containers=[recovered])) == ""
    clean_exit = crash_looping("worker", "", reason="Completed", code=0)
    assert pod_problem(pod_body("p", "worker", containers=[clean_exit])) == (
        "is crash-looping: Completed, exit code 0")
    pull = {"name": "worker", "ready": False, "state": {"waiting": {
        "reason": "ImagePullBackOff", "message": 'Back-off pulling image "ghcr.io/x/y:1"'}}}
    assert pod_problem(pod_body("p", "worker", containers=[pull])) == (
        'is waiting: ImagePullBackOff: Back-off pulling image "ghcr.io/x/y:1"')
    creating = {"name": "worker", "ready": False,
                "state": {"waiting": {"reason": "ContainerCreating"}}}
    assert pod_problem(pod_body("p", "worker", containers=[creating])) == ""


def test_a_failed_init_container_and_an_unschedulable_pod() -> None:
    prepare = crash_looping("prepare-segment", "chown: /var/run/tandem-cell/gen-1: Operation "
                            "not permitted\n")
    waiting = {"name": "scheduler", "ready": False,
               "state": {"waiting": {"reason": "PodInitializing"}}}
    body = pod_body("p", "scheduler", init=[prepare], containers=[waiting])
    assert pod_problem(body) == (
        "is crash-looping in init container prepare-segment: chown: "
        "/var/run/tandem-cell/gen-1: Operation not permitted (Error, exit code 1)")
    done = {"name": "prepare-segment", "ready": True,
            "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
    assert pod_problem(pod_body("p", "scheduler", init=[done], containers=[waiting])) == ""
    pending = pod_body("p", "worker", conditions=[{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": '0/3 nodes are available: persistentvolumeclaim "models" not found.'}])
    assert pod_problem(pending) == (
        'cannot be scheduled: 0/3 nodes are available: persistentvolumeclaim "models" not found.')


def test_a_long_message_is_cut() -> None:
    body = pod_body("p", "worker", containers=[crash_looping("worker", "x" * 5000)])
    problem = pod_problem(body)
    assert problem == f"is crash-looping: {'x' * (PROBLEM_CHARS - 1)}… (Error, exit code 1)"


def test_the_conditions_name_the_failing_pod_and_its_error() -> None:
    """Ready (SchedulersNotReady: the scheduler waits for its workers) and WorkersReady both
    quote the worker's start-up error, first (before the scheduler that gave up waiting for
    it); workers failing alike are counted once."""
    failing = [pod_info(pod_body(f"demo-0-workers-{i}", "worker",
                                 containers=[crash_looping("worker", MODEL_ERROR)]))
               for i in range(2)]
    gave_up = "tandem scheduler: error: worker not reachable: DEADLINE_EXCEEDED"
    scheduler = pod_info(pod_body("demo-0-scheduler-0", "scheduler", containers=[
        crash_looping("scheduler", gave_up, code=2)]))
    obs = {0: observe_cell(SPEC, CELLS[0], "h", [scheduler, *failing])}
    verdicts = fold_verdicts(SPEC, CELLS[:1], obs, {})
    problem = (f"worker pod demo-0-workers-0 is crash-looping: {MODEL_ERROR} (Error, exit code "
               "1) (and 1 more pods alike)")
    assert verdicts["WorkersReady"] == ("False", "WorkersNotReady", (
        f"{problem}; 0/2 workers ready on the current config; waiting for StatefulSet "
        "demo-0-workers (0/2 ready)"))
    assert verdicts["SchedulerReady"][2] == (
        f"{problem}; scheduler pod demo-0-scheduler-0 is crash-looping: {gave_up} (Error, exit "
        "code 2); 0/1 schedulers ready on the current config; waiting for StatefulSet "
        "demo-0-scheduler")
    conditions = {c["type"]: c for c in render_conditions(verdicts, [], "T", 1)}
    assert conditions["Ready"]["reason"] == "SchedulersNotReady"
    assert conditions["Ready"]["message"].startswith(problem)


def test_a_crash_looping_scheduler_is_named_and_many_problems_are_counted() -> None:
    spec = tandem_spec({"cells": 5})
    cells = [Cell(i, "a", GI, GI, 1) for i in range(5)]
    pods = [pod_info(pod_body(f"demo-{i}-scheduler-0", "scheduler", cell=i, containers=[
        crash_looping("scheduler", f"tandem scheduler: error: problem {i}")])) for i in range(5)]
    obs = {c.index: observe_cell(spec, c, "h", pods) for c in cells}
    message = fold_verdicts(spec, cells, obs, {})["SchedulerReady"][2]
    assert message.startswith("scheduler pod demo-0-scheduler-0 is crash-looping: tandem "
                              "scheduler: error: problem 0 (Error, exit code 1); scheduler pod "
                              "demo-1-scheduler-0 is crash-looping: ")
    assert "problem 2" in message and "problem 3" not in message
    assert "; and 2 more pod problems; 0/5 schedulers ready" in message


def test_a_real_worker_with_a_bad_model_says_why_in_the_condition(tmp_path: Path) -> None:
    """`tandem worker` on a model directory with an unknown model_type, its output cut the
    way kubelet cuts a log for FallbackToLogsOnError (the last 80 lines, at most 2048
    bytes): the condition names the file and the key."""
    model = tmp_path / "q"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "foo"}))
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    proc = subprocess.run(
        [sys.executable, "-m", "tandem_cli.cli", "worker", "--model", str(model), "--shm-dir",
         str(shm), "--device", "cpu", "--health-listen", "127.0.0.1:0"],
        capture_output=True, timeout=120, check=False)
    assert proc.returncode != 0
    log = (proc.stdout + proc.stderr).splitlines(keepends=True)[-80:]
    tail = b"".join(log)[-2048:].decode(errors="replace")
    body = pod_body("demo-0-workers-0", "worker",
                    containers=[crash_looping("worker", tail, code=proc.returncode)])
    problem = pod_info(body).problem
    assert problem.startswith("is crash-looping: ") and "Traceback" not in problem
    assert f"{model}/config.json" in problem and "'model_type'" in problem, problem
