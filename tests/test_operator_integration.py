"""The real operator (`tandem_operator.main.run`, i.e. `tandem operator`, in a subprocess) against
the API emulator over HTTP: create, resize, repair, scale-down, delete, the specs it cannot
serve, three tensor-parallel cells behind Envoy and the endpoint picker (a spec still
naming the removed router), and cache sizing from a cell's
CacheStats. Each test uses its own namespace and TandemService, so they do not depend on each
other. A second emulator drops the CRD's CEL rules, as some apiservers do: there the
operator's parser is the only check.

Where the operator reads a cell's CacheStats (its scheduler pod's IP, loopback in the
emulator, on `scheduler.port`), a real gRPC server in the test answers with a chosen curve.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import kubernetes
import pytest
from kube_emulator import KubeEmulator
from kube_emulator.fixtures import CRD_PATH, node
from test_crd_cel import VIOLATIONS

from tandem.v1 import generate_pb2, generate_pb2_grpc
from tandem_operator.kube import KubeApi, Rejected
from tandem_testing.cells import stop_process

T = TypeVar("T")
GI = 1 << 30
MERGE = "application/merge-patch+json"
NODES = ("node-a", "node-b")


@dataclass
class Cluster:
    emulator: KubeEmulator
    core: kubernetes.client.CoreV1Api
    apps: kubernetes.client.AppsV1Api
    batch: kubernetes.client.BatchV1Api
    custom: kubernetes.client.CustomObjectsApi
    liveness: str
    log: Path

    def create(self, namespace: str, name: str, spec: dict[str, Any],
               ns_labels: dict[str, str] | None = None) -> None:
        self.core.create_namespace({"metadata": {"name": namespace, "labels": ns_labels or {}}})
        self.custom.create_namespaced_custom_object(
            "tandem.dev", "v1alpha1", namespace, "tandemservices",
            {"apiVersion": "tandem.dev/v1alpha1", "kind": "TandemService",
             "metadata": {"name": name}, "spec": spec})

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = self.custom.get_namespaced_custom_object(
            "tandem.dev", "v1alpha1", namespace, "tandemservices", name)
        return obj

    def patch(self, namespace: str, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            "tandem.dev", "v1alpha1", namespace, "tandemservices", name, {"spec": spec},
            _content_type=MERGE)

    def condition(self, namespace: str, name: str, kind: str) -> dict[str, Any]:
        status = self.get(namespace, name).get("status") or {}
        found = [c for c in status.get("conditions") or () if c["type"] == kind]
        return found[0] if found else {}

    def pods(self, namespace: str) -> list[Any]:
        return list(self.core.list_namespaced_pod(namespace).items)

    def events(self, namespace: str) -> list[tuple[str, str, str]]:
        """(type, reason, message) of the namespace's Events, oldest first."""
        return [(e.type, e.reason, e.message)
                for e in self.core.list_namespaced_event(namespace).items]


def wait_for(fn: Callable[[], T], what: str, timeout: float = 20.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def running_cluster(tmp: Path, cel_validation: bool) -> Iterator[Cluster]:
    """The emulator with two GPU nodes, and the operator against it in a subprocess."""
    emulator = KubeEmulator([CRD_PATH], cel_validation)
    emulator.start()
    kubeconfig = emulator.write_kubeconfig(tmp / "kubeconfig")
    config = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(str(kubeconfig), client_configuration=config)
    api = kubernetes.client.ApiClient(config)
    core = kubernetes.client.CoreV1Api(api)
    for name in NODES:
        body = node(name, memory="256Gi", gpus=8)
        core.create_node({"metadata": body["metadata"]})
        core.patch_node_status(name, {"status": body["status"]}, _content_type=MERGE)
    liveness = f"http://127.0.0.1:{free_port()}/healthz"
    log = tmp / "operator.log"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "TANDEM_OPERATOR_RESYNC_SECONDS": "1",
           "TANDEM_OPERATOR_CLEANUP_TIMEOUT_SECONDS": "20", "TANDEM_OPERATOR_CACHE_SECONDS": "1",
           "TANDEM_OPERATOR_CACHE_MIN_REFERENCES": "100", "TANDEM_OPERATOR_LEAK_SECONDS": "2"}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from tandem_operator.main import run; "
             "sys.exit(run(sys.argv[1:]))", "--liveness", liveness, "--verbose"],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield Cluster(emulator, core, kubernetes.client.AppsV1Api(api),
                      kubernetes.client.BatchV1Api(api), kubernetes.client.CustomObjectsApi(api),
                      liveness, log)
        emulator.call(lambda store: store.check_invariants())
    except BaseException:
        print(log.read_text()[-20000:])
        raise
    finally:
        stop_process(proc, 15)
        api.close()
        emulator.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A current cluster: the apiserver enforces the CRD's CEL rules."""
    with running_cluster(tmp_path_factory.mktemp("operator"), cel_validation=True) as c:
        yield c


@pytest.fixture(scope="module")
def cluster_without_cel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """An apiserver that drops the CRD's CEL rules (before 1.25, or the feature gate off)."""
    with running_cluster(tmp_path_factory.mktemp("operator-no-cel"), cel_validation=False) as c:
        yield c


def is_ready(cluster: Cluster, namespace: str, name: str) -> bool:
    return cluster.condition(namespace, name, "Ready").get("status") == "True"


def test_liveness_endpoint(cluster: Cluster) -> None:
    def ok() -> bool:
        try:
            with urllib.request.urlopen(cluster.liveness, timeout=1) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False
    wait_for(ok, "the liveness endpoint")


def test_create_then_delete(cluster: Cluster) -> None:
    ns, name = "alpha", "svc"
    cluster.create(ns, name, {"cells": 2, "featureCache": {"size": "4Gi"}})
    wait_for(lambda: is_ready(cluster, ns, name), "Ready")
    status = cluster.get(ns, name)["status"]
    assert sorted(c["nodeName"] for c in status["cells"]) == sorted(NODES)
    assert [c["segmentBytes"] for c in status["cells"]] == [4 * GI, 4 * GI]
    assert status["endpoint"] == "dns:///svc.alpha.svc:50051"
    assert status["observedGeneration"] == 1
    for cell in status["cells"]:
        i, node_name = cell["index"], cell["nodeName"]
        workers = cluster.apps.read_namespaced_stateful_set(f"svc-{i}-workers", ns)
        assert workers.metadata.owner_references[0].kind == "TandemService"
        pod_spec = workers.spec.template.spec
        pinned = pod_spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
        assert pinned.node_selector_terms[0].match_fields[0].values == [node_name]
        assert pod_spec.affinity.pod_affinity.required_during_scheduling_ignored_during_execution
        assert pod_spec.volumes[0].host_path.path == f"/dev/shm/tandem/alpha.svc.{i}"
        assert pod_spec.containers[0].readiness_probe.grpc.port == 50061
        config = cluster.core.read_namespaced_config_map(f"svc-{i}-config", ns).data
        assert config["TANDEM_MM_CACHE_SIZE"] == str(4 * GI)
        assert config["TANDEM_WORKER_ADDRESSES"] == "unix:///var/run/tandem/worker-0.sock"
    pods = cluster.pods(ns)
    assert sorted(p.spec.node_name for p in pods) == sorted(NODES * 2)  # 2 cells x (1 + 1)
    # Two cells: the default standalone routing adds the endpoint picker's Service.
    assert {s.metadata.name for s in cluster.core.list_namespaced_service(ns).items} == {
        "svc", "svc-headless", "svc-workers", "svc-epp"}

    cluster.custom.delete_namespaced_custom_object("tandem.dev", "v1alpha1", ns,
                                                   "tandemservices", name)

    def gone() -> bool:
        try:
            cluster.get(ns, name)
            return False
        except kubernetes.client.ApiException as e:
            return e.status == 404
    wait_for(gone, "the finalizer to be released")
    jobs = cluster.emulator.call(lambda store: [
        o for _, kind, key, o in store.log if key == "batch/jobs" and kind == "ADDED"])
    assert sorted((j["metadata"]["name"], j["spec"]["template"]["spec"]["nodeName"])
                  for j in jobs) == sorted((f"svc-{c['index']}-cleanup", c["nodeName"])
                                           for c in status["cells"])
    assert cluster.apps.list_namespaced_stateful_set(ns).items == []  # collected with the owner
    assert cluster.pods(ns) == []


def test_resize_rolls_the_cells_one_at_a_time(cluster: Cluster) -> None:
    ns, name = "beta", "svc"
    cluster.create(ns, name, {"cells": 2})
    wait_for(lambda: is_ready(cluster, ns, name), "Ready")
    before = {p.metadata.name: p.metadata.annotations["tandem.dev/config-hash"]
              for p in cluster.pods(ns)}
    cluster.patch(ns, name, {"featureCache": {"size": "2Gi"}})

    def resized() -> bool:
        status = cluster.get(ns, name)["status"]
        return status["observedGeneration"] == 2 and is_ready(cluster, ns, name) and all(
            c["segmentBytes"] == 2 * GI and c["segmentGeneration"] == 2 for c in status["cells"])
    wait_for(resized, "the resized cells to be Ready")
    after = {p.metadata.name: p.metadata.annotations["tandem.dev/config-hash"]
             for p in cluster.pods(ns)}
    assert after.keys() == before.keys()
    assert all(after[p] != before[p] for p in after)  # every pod was rolled
    # cell 1 got its new config only after cell 0's new pods existed
    log = cluster.emulator.call(lambda store: [
        (rv, key, o["metadata"]["name"]) for rv, kind, key, o in store.log
        if o["metadata"].get("namespace") == ns and kind != "DELETED"])
    config1 = max(rv for rv, key, n in log if key == "/configmaps" and n == "svc-1-config")
    new_pod0 = max(rv for rv, key, n in log if key == "/pods" and n == "svc-0-workers-0")
    assert new_pod0 < config1


def test_a_worker_on_another_node_is_repaired(cluster: Cluster) -> None:
    ns, name = "gamma", "svc"
    cluster.create(ns, name, {"cells": 1})
    wait_for(lambda: is_ready(cluster, ns, name), "Ready")
    [cell] = cluster.get(ns, name)["status"]["cells"]
    elsewhere = next(n for n in NODES if n != cell["nodeName"])
    cluster.core.patch_namespaced_pod("svc-0-workers-0", ns, {"spec": {"nodeName": elsewhere}},
                                      _content_type=MERGE)
    def repaired_event() -> list[str]:
        return [m for kind, reason, m in cluster.events(ns)
                if (kind, reason) == ("Warning", "CellRepaired")]
    [message] = wait_for(repaired_event, "the CellRepaired event")
    assert message.startswith(f"cell 0: its worker pod svc-0-workers-0 ran on {elsewhere}, not "
                              f"on the cell's node {cell['nodeName']}; the operator re-placed it "
                              "on ")
    assert "with a fresh segment (generation 2), deleted pod svc-0-workers-0" in message

    def repaired() -> bool:
        [now] = cluster.get(ns, name)["status"]["cells"]
        return now["segmentGeneration"] == 2 and is_ready(cluster, ns, name) and all(
            p.spec.node_name == now["nodeName"] for p in cluster.pods(ns))
    wait_for(repaired, "the cell to run colocated on a new generation")
    assert cluster.condition(ns, name, "Colocated")["status"] == "True"


def test_scale_down_removes_the_last_cell_and_its_segment(cluster: Cluster) -> None:
    ns, name = "delta", "svc"
    cluster.create(ns, name, {"cells": 2})
    wait_for(lambda: is_ready(cluster, ns, name), "Ready")
    node1 = cluster.get(ns, name)["status"]["cells"][1]["nodeName"]
    cluster.patch(ns, name, {"cells": 1})
    def removed_event() -> list[str]:
        return [m for kind, reason, m in cluster.events(ns)
                if (kind, reason) == ("Normal", "CellRemoved")]
    [message] = wait_for(removed_event, "the CellRemoved event")
    assert message == ("cell 1 removed (spec.cells is 1): deleted StatefulSets svc-1-scheduler "
                       "and svc-1-workers and ConfigMap svc-1-config; started Job "
                       f"svc-1-cleanup-g1 to remove generation 1 from {node1}")
    assert [s.metadata.name for s in cluster.apps.list_namespaced_stateful_set(ns).items] == [
        "svc-0-scheduler", "svc-0-workers"]
    job = cluster.batch.read_namespaced_job("svc-1-cleanup-g1", ns)
    assert job.spec.template.spec.node_name == node1
    wait_for(lambda: len(cluster.get(ns, name)["status"]["cells"]) == 1, "one cell in status")


def test_a_spec_no_node_can_hold_gets_a_clear_condition(cluster: Cluster) -> None:
    ns, name = "epsilon", "huge"
    cluster.create(ns, name, {"worker": {"gpu": {"count": 16}}})
    placement = wait_for(lambda: cluster.condition(ns, name, "PlacementReady"), "conditions")
    assert placement["status"] == "False" and placement["reason"] == "NoFittingNode"
    # the other tests' cells hold some of the 8 GPUs of each node
    assert re.search(r"node-a: needs 16 nvidia.com/gpu, \d free", placement["message"])
    assert re.search(r"node-b: needs 16 nvidia.com/gpu, \d free", placement["message"])
    assert cluster.condition(ns, name, "Ready")["reason"] == "NoFittingNode"
    assert cluster.apps.list_namespaced_stateful_set(ns).items == []

    def retried() -> list[str]:
        return [m for kind, reason, m in cluster.events(ns)
                if (kind, reason) == ("Error", "Logging") and "failed temporarily" in m]
    [event, *_] = wait_for(retried, "the Event of the retry")
    assert event.startswith("Handler 'reconcile/cell-0' failed temporarily: cell 0 is not "
                            "placed, 0/2 nodes fit: node-a: needs 16 nvidia.com/gpu")
    assert event.endswith("; trying again in 5 s")


def test_pod_security_rejection_is_reported(cluster: Cluster) -> None:
    ns, name = "zeta", "svc"
    cluster.create(ns, name, {}, ns_labels={"pod-security.kubernetes.io/enforce": "baseline"})

    def rejected() -> dict[str, Any]:
        found = cluster.condition(ns, name, "PlacementReady")
        return found if found.get("reason") == "PodSecurityRejected" else {}
    placement = wait_for(rejected, "PodSecurityRejected")
    assert placement["status"] == "False" and "hostPath" in placement["message"]
    assert cluster.apps.list_namespaced_stateful_set(ns).items == []


def test_the_apiserver_refuses_what_a_cel_rule_refuses(cluster: Cluster) -> None:
    with pytest.raises(kubernetes.client.ApiException) as refused:
        cluster.create("eta", "svc", {"worker": {"workersPerCell": 3, "tensorParallelSize": 2}})
    assert refused.value.status == 422
    assert json.loads(refused.value.body)["message"] == (
        'TandemService.tandem.dev "svc" is invalid: spec.worker: Invalid value: "object": '
        "workersPerCell must be a multiple of tensorParallelSize")


def test_without_cel_the_operator_refuses_every_rule_with_invalid_spec(
        cluster_without_cel: Cluster) -> None:
    cluster = cluster_without_cel
    cases = [(f"rule-{i}", name) for i, (name, _) in enumerate(VIOLATIONS.values())]
    for (ns, name), (_, spec) in zip(cases, VIOLATIONS.values(), strict=True):
        cluster.create(ns, name, spec)
    for ns, name in cases:
        def invalid(ns: str = ns, name: str = name) -> dict[str, Any]:
            found = cluster.condition(ns, name, "Ready")
            return found if found.get("reason") == "InvalidSpec" else {}
        ready = wait_for(invalid, f"InvalidSpec in {ns}")
        assert cluster.condition(ns, name, "PlacementReady")["reason"] == "InvalidSpec"
        assert cluster.apps.list_namespaced_stateful_set(ns).items == []
        failed = f"Handler 'reconcile' failed permanently: {ready['message']}"
        wait_for(lambda ns=ns, failed=failed: ("Error", "Logging", failed) in cluster.events(ns),
                 f"the Event of the permanent failure in {ns}")


def test_three_tensor_parallel_cells_behind_envoy_and_the_picker(cluster: Cluster) -> None:
    """Written as for the removed router (routing.mode router, spec.router): it serves as
    standalone routing, and the operator says what to change in warning events."""
    ns, name = "theta", "svc"
    cluster.create(ns, name, {"cells": 3, "placement": {"maxCellsPerNode": 2},
                              "worker": {"workersPerCell": 2, "tensorParallelSize": 2,
                                         "device": "cpu", "gpu": {"count": 0}},
                              "routing": {"mode": "router"}, "router": {"replicas": 2}})
    wait_for(lambda: is_ready(cluster, ns, name), "Ready")
    cells = cluster.get(ns, name)["status"]["cells"]
    assert len(cells) == 3 and all(c["workersReady"] == c["workersTotal"] == 2 for c in cells)
    for i in range(3):
        config = cluster.core.read_namespaced_config_map(f"svc-{i}-config", ns).data
        assert config["TANDEM_TENSOR_PARALLEL_SIZE"] == "2"
        assert config["TANDEM_TP_MASTER_ADDR"] == f"svc-{i}-workers-0.svc-workers.{ns}.svc"
        assert cluster.apps.read_namespaced_stateful_set(
            f"svc-{i}-workers", ns).spec.service_name == "svc-workers"
    workers_svc = cluster.core.read_namespaced_service("svc-workers", ns)
    assert workers_svc.spec.cluster_ip == "None" and workers_svc.spec.publish_not_ready_addresses

    def picker_cells() -> list[str]:
        try:
            data = cluster.core.read_namespaced_config_map("svc-epp", ns).data
        except kubernetes.client.ApiException:
            return []
        return [c.split(".")[0] for c in data["TANDEM_EPP_CELLS"].split(",")]

    def service_target() -> str:
        return str(cluster.core.read_namespaced_service("svc", ns).spec.selector[
            "app.kubernetes.io/component"])
    assert picker_cells() == [f"svc-{i}-scheduler-0" for i in range(3)]
    wait_for(lambda: service_target() == "envoy", "the Service to point at Envoy")
    envoy = cluster.apps.read_namespaced_deployment("svc-envoy", ns)
    assert envoy.metadata.owner_references[0].kind == "TandemService"
    assert envoy.spec.template.spec.containers[0].command[0] == "envoy"
    epp = cluster.apps.read_namespaced_deployment("svc-epp", ns)
    assert epp.spec.template.spec.containers[0].command == ["tandem", "epp"]
    hash3 = epp.spec.template.metadata.annotations["tandem.dev/config-hash"]

    def warned() -> set[str]:
        return {message.split(":")[0] for kind, reason, message in cluster.events(ns)
                if (kind, reason) == ("Warning", "Deprecated")}
    wait_for(lambda: warned() == {"routing.mode router is deprecated",
                                  "spec.router is ignored since tandem router was removed"},
             "a deprecation warning for the router's mode and for spec.router")

    def picker_hash() -> str:
        deployment = cluster.apps.read_namespaced_deployment("svc-epp", ns)
        return str(deployment.spec.template.metadata.annotations["tandem.dev/config-hash"])
    cluster.patch(ns, name, {"cells": 2})
    # The ConfigMap is applied before the Deployment: wait for both, not the first alone.
    wait_for(lambda: picker_cells() == ["svc-0-scheduler-0", "svc-1-scheduler-0"]
             and picker_hash() != hash3, "the picker's cells and pods to follow the scale-down")

    cluster.patch(ns, name, {"cells": 1})
    wait_for(lambda: service_target() == "scheduler", "the Service back on the scheduler")
    wait_for(lambda: not cluster.apps.list_namespaced_deployment(ns).items,
             "Envoy and the picker to be removed with one cell left")
    assert picker_cells() == []


def test_a_refused_api_call_names_the_call(cluster: Cluster) -> None:
    """What kopf posts when a handler fails with it: the call and the apiserver's words, not
    the client's HTTP dump."""
    ns = "iota"
    cluster.core.create_namespace({"metadata": {"name": ns, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted"}}})
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": ns},
           "spec": {"containers": [{"name": "c", "image": "i"}],
                    "volumes": [{"name": "v", "hostPath": {"path": "/x"}}]}}
    with pytest.raises(Rejected) as refused:
        asyncio.run(KubeApi(cluster.core.api_client).apply(pod))
    assert str(refused.value) == (
        f'creating Pod {ns}/p was refused (403): pods "p" is forbidden: violates PodSecurity '
        '"restricted:latest": hostPath volumes (volumes "v")')
    assert refused.value.pod_security


def test_a_worker_that_cannot_load_its_model_is_named_in_the_status(cluster: Cluster) -> None:
    """The model's claim (a subPath of it) is mounted into the scheduler and the worker, and
    when kubelet reports the worker crash-looping with its start-up error as termination
    message, WorkersReady and Ready quote it with the pod's name."""
    ns, name = "kappa", "svc"
    cluster.create(ns, name, {"model": {"path": "/models/q", "claimName": "models",
                                        "subPath": "qwen2-vl"}})
    wait_for(lambda: is_ready(cluster, ns, name), "Ready")
    for sts in ("svc-0-scheduler", "svc-0-workers"):
        template = cluster.apps.read_namespaced_stateful_set(sts, ns).spec.template.spec
        [volume] = [v for v in template.volumes if v.name == "model"]
        assert volume.persistent_volume_claim.claim_name == "models"
        [mount] = [m for m in template.containers[0].volume_mounts if m.name == "model"]
        assert (mount.mount_path, mount.sub_path, mount.read_only) == ("/models/q", "qwen2-vl",
                                                                       True)
    error = "tandem worker: error: /models/q/config.json: key 'model_type' is 'foo'"
    cluster.core.patch_namespaced_pod_status("svc-0-workers-0", ns, {"status": {
        "conditions": [{"type": "Ready", "status": "False"}],
        "containerStatuses": [{
            "name": "worker", "ready": False, "restartCount": 3, "image": "i", "imageID": "",
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                         "message": f"loading /models/q\n{error}\n"}}}]}},
        _content_type=MERGE)
    problem = f"worker pod svc-0-workers-0 is crash-looping: {error} (Error, exit code 1)"

    def reported() -> bool:
        return cluster.condition(ns, name, "WorkersReady").get("message", "").startswith(problem)
    wait_for(reported, "WorkersReady to name the failing worker")
    ready = cluster.condition(ns, name, "Ready")
    assert ready["status"] == "False" and ready["message"].startswith(problem)


class StatsCell(generate_pb2_grpc.GenerationServicer):
    """Stands in for a cell's scheduler where the operator reads CacheStats: answers with
    `stats`, which the test changes as it goes."""

    def __init__(self, stats: generate_pb2.CacheStatsResponse) -> None:
        self.stats = stats
        self.calls = 0

    def CacheStats(self, request: generate_pb2.CacheStatsRequest,
                   context: grpc.ServicerContext) -> generate_pb2.CacheStatsResponse:
        self.calls += 1
        return self.stats


def curve(recommended: int, references: int = 5000, unacked: int = 0,
          capacity: int = GI) -> generate_pb2.CacheStatsResponse:
    return generate_pb2.CacheStatsResponse(
        mm_cache_type="shm", mm_cache_capacity_bytes=capacity, shm_capacity_bytes=capacity,
        mm_cache_recommended_bytes=recommended, mm_cache_curve_references=references,
        mm_cache_achievable_hit_ratio=0.8, shm_unacked_refs=unacked, requests_in_flight=0,
        mm_cache_curve=[generate_pb2.CurvePoint(capacity_bytes=int(capacity * f), hit_ratio=r)
                        for f, r in ((0.5, 0.2), (1, 0.4), (2, 0.7))])


@contextlib.contextmanager
def stats_cell(stats: generate_pb2.CacheStatsResponse) -> Iterator[tuple[StatsCell, int]]:
    """A real gRPC server on a free loopback port serving StatsCell."""
    cell = StatsCell(stats)
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    generate_pb2_grpc.add_GenerationServicer_to_server(cell, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield cell, port
    finally:
        server.stop(0)


def resizes(cluster: Cluster, ns: str) -> list[str]:
    return [m for kind, reason, m in cluster.events(ns) if (kind, reason) == ("Normal",
                                                                              "CacheResized")]


def test_an_undersized_cell_gets_the_condition_and_the_recommendation(cluster: Cluster) -> None:
    ns, name = "lambda", "svc"
    with stats_cell(curve(recommended=3 * GI)) as (cell, port):
        cluster.create(ns, name, {"scheduler": {"port": port}, "featureCache": {"size": "1Gi"}})

        def undersized() -> dict[str, Any]:
            found = cluster.condition(ns, name, "CacheSized")
            return found if found.get("reason") == "Undersized" else {}
        sized = wait_for(undersized, "CacheSized Undersized")
        assert sized["status"] == "False" and cell.calls > 0
        assert sized["message"].startswith("cell 0 (1Gi cache on node-")
        assert sized["message"].endswith("set spec.featureCache.size to 3Gi (or set "
                                         "featureCache.autoSize to let the operator size it)")
        cache = cluster.get(ns, name)["status"]["cache"]
        assert cache["recommendedSize"] == "3Gi"
        assert cache["cells"][0] | {"references": 5000, "recommendedBytes": 3 * GI} == \
            cache["cells"][0] and cache["cells"][0]["verdict"] == "Undersized"
        assert cluster.condition(ns, name, "ReferencesLeaking")["status"] == "False"
        assert cluster.condition(ns, name, "Ready")["status"] == "True"  # advice, not a fault


def test_autosize_resizes_within_its_bounds_once_per_stable_curve(cluster: Cluster) -> None:
    ns, name = "mu", "svc"
    with stats_cell(curve(recommended=3 * GI)) as (cell, port):
        cluster.create(ns, name, {"scheduler": {"port": port}, "featureCache": {
            "size": "1Gi", "autoSize": {"min": "512Mi", "max": "8Gi"}}})

        def sized_to(size: int, generation: int) -> bool:
            [c] = cluster.get(ns, name).get("status", {}).get("cells") or [{}]
            return (c.get("segmentBytes"), c.get("requestedBytes"),
                    c.get("segmentGeneration")) == (size, size, generation) and \
                is_ready(cluster, ns, name)
        wait_for(lambda: sized_to(3 * GI, 2), "the cell resized to 3Gi", timeout=30)
        config = cluster.core.read_namespaced_config_map(f"{name}-0-config", ns).data
        assert config["TANDEM_MM_CACHE_SIZE"] == str(3 * GI)
        wait_for(lambda: cluster.condition(ns, name, "CacheSized").get("reason") == "Right",
                 "CacheSized Right at the new size")
        calls = cell.calls
        wait_for(lambda: cell.calls >= calls + 3, "three more reads of the same curve")
        assert sized_to(3 * GI, 2)
        [event] = resizes(cluster, ns)
        assert event.startswith("cell 0: autoSize resized its cache from 1Gi to 3Gi")

        cell.stats = curve(recommended=20 * GI, capacity=3 * GI)  # the workload changed
        wait_for(lambda: sized_to(8 * GI, 3), "the cell resized to autoSize.max", timeout=30)
        calls = cell.calls
        wait_for(lambda: cell.calls >= calls + 3, "three more reads")
        assert sized_to(8 * GI, 3) and len(resizes(cluster, ns)) == 2
        sized = cluster.condition(ns, name, "CacheSized")
        assert sized["reason"] == "Undersized"
        assert sized["message"].endswith("autoSize keeps it at its bound 8Gi")


def test_references_left_unacknowledged_while_idle_are_reported(cluster: Cluster) -> None:
    ns, name = "nu", "svc"
    with stats_cell(curve(recommended=GI, unacked=3)) as (cell, port):
        cluster.create(ns, name, {"scheduler": {"port": port}, "featureCache": {"size": "1Gi"}})

        def leaking() -> dict[str, Any]:
            found = cluster.condition(ns, name, "ReferencesLeaking")
            return found if found.get("status") == "True" else {}
        condition = wait_for(leaking, "ReferencesLeaking")
        assert condition["message"].startswith(
            "cell 0: 3 segment references unacknowledged while the cell handled no request "
            "for more than 2 s")
        warned = wait_for(lambda: [m for kind, reason, m in cluster.events(ns)
                                   if (kind, reason) == ("Warning", "ReferencesLeaking")],
                          "the ReferencesLeaking Event")
        assert warned == [condition["message"]]
        cell.stats = curve(recommended=GI, unacked=0)
        wait_for(lambda: cluster.condition(ns, name, "ReferencesLeaking").get("status")
                 == "False", "ReferencesLeaking cleared")
        assert cluster.condition(ns, name, "CacheSized")["reason"] == "Right"
