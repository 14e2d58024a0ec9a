"""The pure manifest builders: field asserts, and every manifest through kubernetes-validate
--strict for Kubernetes 1.30 and the newest version the package bundles."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kube_emulator.fixtures import tandem_spec

from tandem.shutdown import DEFAULT_GRACE_S, STOP_MARGIN_S
from tandem_cli.cli import build_parser
from tandem_operator.gateway import (
    build_envoy_configmap,
    build_envoy_deployment,
    build_epp_configmap,
    build_epp_deployment,
    build_epp_service,
)
from tandem_operator.manifests import (
    build_cleanup_job,
    build_configmap,
    build_service,
    build_workers_service,
    cell_config,
    config_hash,
    endpoint,
)
from tandem_operator.placement import Cell
from tandem_operator.spec import MAX_CELLS, MAX_NAME_LENGTH
from tandem_operator.workloads import build_pod_template, build_statefulset

GI = 1 << 30
CELL = Cell(index=1, node="gpu-7", cache_bytes=3 * GI, requested_bytes=4 * GI, generation=5)
VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]


def container(obj: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = obj["spec"]["template"]["spec"]["containers"]
    return containers[0]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def every_manifest() -> list[dict[str, Any]]:
    spec = tandem_spec({
        "cells": 2, "model": {"path": "/models/m", "claimName": "weights", "subPath": "m"},
        "image": {"pullSecrets": ["ghcr"]},
        "tracing": {"endpoint": "otel-collector:4317"},
        "tls": {"secretName": "demo-tls", "clientCASecretName": "tenants-ca"},
        "worker": {"workersPerCell": 2, "tensorParallelSize": 2,
                   "env": [{"name": "TANDEM_KV_CACHE_SIZE", "value": "1Gi"}]},
        "placement": {"nodeSelector": {"pool": "gpu"},
                      "tolerations": [{"key": "gpu", "operator": "Exists"}],
                      "affinity": {"podAntiAffinity": {
                          "preferredDuringSchedulingIgnoredDuringExecution": [{
                              "weight": 10, "podAffinityTerm": {
                                  "topologyKey": "kubernetes.io/hostname",
                                  "labelSelector": {"matchLabels": {"app": "db"}}}}]}}}})
    template = build_pod_template(spec, CELL, "scheduler")
    pod = {"apiVersion": "v1", "kind": "Pod", "spec": template["spec"],
           "metadata": {**template["metadata"], "name": "p", "namespace": "serving"}}
    cells = [CELL, Cell(0, "gpu-1", GI, GI, 1)]
    on_node = tandem_spec({"model": {"path": "/models/m", "hostPath": "/var/lib/models/m"}})
    return [build_configmap(spec, CELL), build_statefulset(spec, CELL, "scheduler"),
            build_statefulset(spec, CELL, "worker"), build_statefulset(on_node, CELL, "worker"),
            build_service(spec),
            build_service(spec, headless=True), build_cleanup_job(spec, 1, "gpu-7"),
            build_cleanup_job(spec, 1, "gpu-7", generation=4), pod,
            build_service(spec, front="envoy"), build_workers_service(spec),
            build_epp_configmap(spec, cells), build_epp_deployment(spec, cells),
            build_epp_service(spec), build_envoy_configmap(spec, cells),
            build_envoy_deployment(spec, cells)]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_passes_strict_schema_validation(version: str) -> None:
    for obj in every_manifest():
        kubernetes_validate.validate(obj, version, strict=True)
    typo = every_manifest()[1]
    container(typo)["livenesProbe"] = {}  # the validator does catch unknown fields
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, version, strict=True)


def test_configmap_carries_the_cell_settings() -> None:
    spec = tandem_spec({"worker": {"workersPerCell": 2}, "prefixCache": {"enabled": False}})
    cm = build_configmap(spec, CELL)
    assert cm["metadata"]["name"] == "demo-1-config"
    assert cm["data"] == {
        "TANDEM_SHM_DIR": "/var/run/tandem",
        "TANDEM_MODEL": "tiny",
        "TANDEM_MM_CACHE": "shm",
        "TANDEM_MM_CACHE_SIZE": str(3 * GI),
        "TANDEM_MM_CACHE_MAX_OBJECT_SIZE": str(64 << 20),
        "TANDEM_ENABLE_PREFIX_CACHING": "false",
        "TANDEM_BLOCK_SIZE": "16",
        "TANDEM_WORKERS": "2",
        "TANDEM_WORKER_ADDRESSES": "unix:///var/run/tandem/worker-0.sock,"
                                   "unix:///var/run/tandem/worker-1.sock",
        "TANDEM_DEVICE": "auto",
        "TANDEM_HEALTH_LISTEN": "0.0.0.0:50061",
        "TANDEM_HTTP_LISTEN": "0.0.0.0:8000",
    }
    assert cm["metadata"]["annotations"]["tandem.dev/config-hash"] == config_hash(cm["data"])


def test_tracing_settings_only_when_an_endpoint_is_set() -> None:
    data = cell_config(tandem_spec({"tracing": {"endpoint": "c:4317", "ratio": "1"}}), CELL)
    assert data["OTEL_EXPORTER_OTLP_ENDPOINT"] == "c:4317"
    assert data["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert data["OTEL_TRACES_SAMPLER_ARG"] == "1"


@pytest.mark.parametrize("component", ["scheduler", "worker", "epp"])
def test_resource_attributes_name_pod_node_and_cell_through_the_downward_api(
        component: str) -> None:
    spec = tandem_spec({})
    if component == "epp":
        pod = build_epp_deployment(spec, [CELL])["spec"]["template"]["spec"]
    else:
        pod = build_pod_template(spec, CELL, component)["spec"]
    env = pod["containers"][0]["env"]
    names = [e["name"] for e in env]
    attrs = env[names.index("OTEL_RESOURCE_ATTRIBUTES")]["value"]
    # $(VAR) expands only from variables defined earlier in the list.
    assert names.index("K8S_POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    assert names.index("K8S_NODE_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    assert env[names.index("K8S_NODE_NAME")]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "spec.nodeName")
    assert "k8s.pod.name=$(K8S_POD_NAME)" in attrs and "k8s.node.name=$(K8S_NODE_NAME)" in attrs
    assert f"k8s.namespace.name={spec.namespace}" in attrs
    assert (f"tandem.cell={CELL.index}" in attrs) == (component != "epp")


def test_scheduler_is_pinned_sized_probed_and_mounted() -> None:
    sts = build_statefulset(tandem_spec({}), CELL, "scheduler")
    assert sts["metadata"]["name"] == "demo-1-scheduler" and sts["spec"]["replicas"] == 1
    pod = sts["spec"]["template"]
    affinity = pod["spec"]["affinity"]
    assert affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": ["gpu-7"]}]}]}
    [anti] = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["labelSelector"]["matchExpressions"] == [
        {"key": "tandem.dev/cell", "operator": "NotIn", "values": ["1"]}]
    c = container(sts)
    assert c["command"] == ["tandem", "scheduler"]
    assert c["image"] == "ghcr.io/tandem-dev/tandem:0.1.0"
    # the cache bytes are charged to the scheduler: default 1Gi request / 2Gi limit + 3Gi
    assert c["resources"] == {"requests": {"cpu": "1", "memory": str(4 * GI)},
                              "limits": {"memory": str(5 * GI)}}
    # probed on the health-only port (plaintext even when Generate speaks TLS)
    assert c["readinessProbe"]["grpc"] == {"port": 50061, "service": "tandem.v1.Generation"}
    assert c["livenessProbe"]["grpc"] == {"port": 50061, "service": ""}
    assert c["livenessProbe"]["failureThreshold"] > 1
    assert c["startupProbe"]["failureThreshold"] == 360
    assert c["ports"] == [{"name": "grpc", "containerPort": 50051, "protocol": "TCP"},
                          {"name": "http", "containerPort": 8000, "protocol": "TCP"},
                          {"name": "health", "containerPort": 50061, "protocol": "TCP"},
                          {"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    assert env_of(c)["TANDEM_LISTEN"] == "0.0.0.0:50051"
    assert env_of(c)["TANDEM_METRICS_PORT"] == "9400"
    assert c["envFrom"] == [{"configMapRef": {"name": "demo-1-config"}}]
    assert c["volumeMounts"] == [{"name": "cell", "mountPath": "/var/run/tandem",
                                  "subPath": "gen-5"}, {"name": "tmp", "mountPath": "/tmp"}]
    assert pod["spec"]["volumes"] == [{"name": "cell", "hostPath": {
        "path": "/dev/shm/tandem/serving.demo.1", "type": "DirectoryOrCreate"}},
        {"name": "tmp", "emptyDir": {}}]
    init = pod["spec"]["initContainers"][0]
    assert init["command"][-4:] == ["/var/run/tandem-cell", "5", "10001:10001", "true"]
    assert pod["metadata"]["annotations"]["tandem.dev/segment-generation"] == "5"


def test_workers_follow_their_scheduler_and_get_rank_gpus_and_shm() -> None:
    spec = tandem_spec({"worker": {"workersPerCell": 2, "gpu": {"count": 2}}})
    sts = build_statefulset(spec, CELL, "worker")
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["podManagementPolicy"] == "Parallel"
    pod = sts["spec"]["template"]["spec"]
    [term] = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "scheduler"
    assert term["labelSelector"]["matchLabels"]["tandem.dev/cell"] == "1"
    assert "podAntiAffinity" not in pod["affinity"]
    c = container(sts)
    assert c["image"] == "ghcr.io/tandem-dev/tandem:0.1.0-cuda"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    env = env_of(c)
    assert env["TANDEM_WORKER_RANK"] == {"fieldRef": {
        "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert "TANDEM_WORKER_LISTEN" not in env, "the Step API stays on the Unix socket"
    assert env["TANDEM_METRICS_PORT"] == "9401"
    assert c["readinessProbe"]["grpc"] == {"port": 50061, "service": ""}
    assert [p["name"] for p in c["ports"]] == ["health", "metrics"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(GI)}} in pod[
        "volumes"]
    assert pod["initContainers"][0]["command"][-1] == "false"  # workers never prune


def test_cpu_workers_use_the_plain_image_and_no_gpus() -> None:
    spec = tandem_spec({"worker": {"device": "cpu", "gpu": {"count": 0}},
                        "sharedMemory": {"disabled": True}})
    c = container(build_statefulset(spec, CELL, "worker"))
    assert c["image"] == "ghcr.io/tandem-dev/tandem:0.1.0"
    assert "limits" not in c["resources"]
    assert [m["name"] for m in c["volumeMounts"]] == ["cell", "tmp"]


def test_a_new_size_changes_the_hash_on_the_pod_templates() -> None:
    spec = tandem_spec({})
    smaller = Cell(1, "gpu-7", 2 * GI, 2 * GI, 6)
    before = build_statefulset(spec, CELL, "worker")["spec"]["template"]["metadata"]
    after = build_statefulset(spec, smaller, "worker")["spec"]["template"]["metadata"]
    key = "tandem.dev/config-hash"
    assert before["annotations"][key] != after["annotations"][key]


def test_services_select_every_cells_scheduler() -> None:
    spec = tandem_spec({})
    svc, headless = build_service(spec), build_service(spec, headless=True)
    assert svc["spec"]["selector"] == headless["spec"]["selector"] == {
        "app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": "demo",
        "app.kubernetes.io/component": "scheduler"}
    assert headless["spec"]["clusterIP"] == "None" and svc["spec"]["type"] == "ClusterIP"
    assert endpoint(spec) == "dns:///demo.serving.svc:50051"


def test_the_http_api_is_on_the_service_and_the_schedulers_unless_disabled() -> None:
    spec = tandem_spec({"http": {"port": 8080}, "tls": {"secretName": "demo-tls"}})
    assert build_service(spec)["spec"]["ports"][1] == {
        "name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP",
        "appProtocol": "https"}
    assert build_configmap(spec, CELL)["data"]["TANDEM_HTTP_LISTEN"] == "0.0.0.0:8080"
    container = build_pod_template(spec, CELL, "scheduler")["spec"]["containers"][0]
    assert {"name": "http", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
    off = tandem_spec({"http": {"enabled": False}})
    assert [p["name"] for p in build_service(off)["spec"]["ports"]] == ["grpc"]
    assert "TANDEM_HTTP_LISTEN" not in build_configmap(off, CELL)["data"]
    container = build_pod_template(off, CELL, "scheduler")["spec"]["containers"][0]
    assert "http" not in {p["name"] for p in container["ports"]}


def test_cleanup_job_is_pinned_and_removes_only_its_target() -> None:
    spec = tandem_spec({})
    job = build_cleanup_job(spec, 1, "gpu-7")
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeName"] == "gpu-7" and pod["tolerations"] == [{"operator": "Exists"}]
    assert pod["containers"][0]["command"] == ["rm", "-rf", "--", "/host/serving.demo.1"]
    assert pod["volumes"][0]["hostPath"]["path"] == "/dev/shm/tandem"
    old = build_cleanup_job(spec, 1, "gpu-7", generation=4)
    assert old["metadata"]["name"] == "demo-1-cleanup-g4"
    assert old["spec"]["template"]["spec"]["containers"][0]["command"][-1] == (
        "/host/serving.demo.1/gen-4")


def test_prepare_script_keeps_the_current_and_newer_generations(tmp_path: Path) -> None:
    """Run the init container's script for real on a scratch cell directory."""
    template = build_pod_template(tandem_spec({}), CELL, "scheduler")
    command = template["spec"]["initContainers"][0]["command"]
    for gen in ("gen-1", "gen-4", "gen-9", "notes"):
        (tmp_path / gen).mkdir()
    args = [str(tmp_path), command[5], f"{os.getuid()}:{os.getgid()}", command[7]]
    subprocess.run([*command[:4], *args], check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen-5", "gen-9", "notes"]
    assert (tmp_path / "gen-5").stat().st_mode & 0o777 == 0o700


def test_tensor_parallel_workers_meet_at_worker_0() -> None:
    spec = tandem_spec({"worker": {"workersPerCell": 4, "tensorParallelSize": 2}})
    data = build_configmap(spec, CELL)["data"]
    assert data["TANDEM_WORKERS"] == "4"
    assert data["TANDEM_TENSOR_PARALLEL_SIZE"] == "2"
    assert data["TANDEM_TP_MASTER_ADDR"] == "demo-1-workers-0.demo-workers.serving.svc"
    assert data["TANDEM_TP_MASTER_PORT"] == "29500"
    sts = build_statefulset(spec, CELL, "worker")
    assert sts["spec"]["serviceName"] == "demo-workers" and sts["spec"]["replicas"] == 4
    assert sts["spec"]["podManagementPolicy"] == "Parallel", "ranks only turn Ready together"
    assert build_statefulset(spec, CELL, "scheduler")["spec"]["serviceName"] == "demo-headless"
    assert "TANDEM_TENSOR_PARALLEL_SIZE" not in cell_config(tandem_spec({}), CELL)


def test_workers_service_names_every_worker_before_it_is_ready() -> None:
    svc = build_workers_service(tandem_spec({}))
    assert svc["metadata"]["name"] == "demo-workers"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "worker"
    assert "tandem.dev/cell" not in svc["spec"]["selector"], "one Service for all cells"


HARDENED = {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


@pytest.mark.parametrize("component", ["scheduler", "worker"])
def test_cell_containers_are_non_root_read_only_and_write_only_to_volumes(
        component: str) -> None:
    spec = tandem_spec({"model": {"path": "/models/m", "claimName": "weights"}})
    pod = build_pod_template(spec, CELL, component)["spec"]
    assert pod["securityContext"] == {"runAsUser": 10001, "runAsGroup": 10001,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    [c] = pod["containers"]
    assert c["securityContext"] == HARDENED
    assert env_of(c)["HOME"] == "/tmp"
    volumes = {v["name"]: v for v in pod["volumes"]}
    writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
    assert writable >= {"/tmp", "/var/run/tandem"}
    assert volumes["tmp"] == {"name": "tmp", "emptyDir": {}}
    assert {"name": "model", "mountPath": "/models/m", "readOnly": True} in c["volumeMounts"]
    [init] = pod["initContainers"]  # root, but only to hand the hostPath to the pods' user
    ctx = init["securityContext"]
    assert ctx["runAsUser"] == 0 and ctx["readOnlyRootFilesystem"] is True
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER", "DAC_OVERRIDE"]}
    assert [m["mountPath"] for m in init["volumeMounts"]] == ["/var/run/tandem-cell"]


MODEL_SOURCES = {
    "claim": ({"claimName": "models", "subPath": "qwen2-vl-2b"},
              {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
              {"subPath": "qwen2-vl-2b"}),
    "claim root": ({"claimName": "models"},
                   {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}, {}),
    "node": ({"hostPath": "/var/lib/tandem/models/q"},
             {"hostPath": {"path": "/var/lib/tandem/models/q", "type": "Directory"}}, {}),
}


@pytest.mark.parametrize("source", MODEL_SOURCES)
def test_the_model_is_mounted_read_only_at_its_path_in_the_scheduler_and_every_worker(
        source: str) -> None:
    fields, volume, extra = MODEL_SOURCES[source]
    spec = tandem_spec({"cells": 2, "model": {"path": "/models/q", **fields},
                        "tls": {"secretName": "demo-tls"}})
    assert build_configmap(spec, CELL)["data"]["TANDEM_MODEL"] == "/models/q"
    for component in ("scheduler", "worker"):
        pod = build_pod_template(spec, CELL, component)["spec"]
        assert [v for v in pod["volumes"] if v["name"] == "model"] == [{"name": "model",
                                                                        **volume}]
        [c] = pod["containers"]
        assert [m for m in c["volumeMounts"] if m["name"] == "model"] == [
            {"name": "model", "mountPath": "/models/q", "readOnly": True, **extra}]
        assert "model" not in [m["name"] for m in pod["initContainers"][0]["volumeMounts"]]
    epp = build_epp_deployment(spec, [CELL])["spec"]["template"]["spec"]
    assert "model" not in [v["name"] for v in epp["volumes"]], "the picker loads no model"


def test_a_preset_or_a_directory_in_the_image_mounts_nothing() -> None:
    for model, setting in (({}, "tiny"), ({"name": "small"}, "small"),
                           ({"path": "/opt/models/q"}, "/opt/models/q")):
        spec = tandem_spec({"model": model})
        assert build_configmap(spec, CELL)["data"]["TANDEM_MODEL"] == setting
        for component in ("scheduler", "worker"):
            pod = build_pod_template(spec, CELL, component)["spec"]
            assert "model" not in [v["name"] for v in pod["volumes"]]


@pytest.mark.parametrize("component", ["scheduler", "worker"])
def test_a_failed_start_leaves_its_last_log_lines_as_the_termination_message(
        component: str) -> None:
    """FallbackToLogsOnError: the one-line start-up error becomes lastState.terminated.message
    (conditions.pod_problem shows it in the TandemService's status)."""
    pod = build_pod_template(tandem_spec({}), CELL, component)["spec"]
    for c in [*pod["containers"], *pod["initContainers"]]:
        assert c["terminationMessagePolicy"] == "FallbackToLogsOnError", c["name"]


def test_picker_envoy_and_cleanup_containers_are_locked_down() -> None:
    spec = tandem_spec({"cells": 2})
    epp = build_epp_deployment(spec, [CELL])["spec"]["template"]["spec"]
    [c] = epp["containers"]
    assert c["securityContext"] == HARDENED
    assert c["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert epp["volumes"] == [{"name": "tmp", "emptyDir": {}}]
    [envoy] = build_envoy_deployment(spec, [CELL])["spec"]["template"]["spec"]["containers"]
    assert envoy["securityContext"] == HARDENED
    [rm] = build_cleanup_job(spec, 1, "gpu-7")["spec"]["template"]["spec"]["containers"]
    ctx = rm["securityContext"]  # root: the cell directory lies in a root-owned 0755 one
    assert ctx["runAsUser"] == 0 and ctx["readOnlyRootFilesystem"] is True
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]}


def test_tls_secrets_are_mounted_into_the_scheduler_and_named_in_the_config() -> None:
    spec = tandem_spec({"tls": {"secretName": "demo-tls", "clientCASecretName": "tenants-ca"}})
    data = build_configmap(spec, CELL)["data"]
    assert data["TANDEM_TLS_CERT"] == "/etc/tandem/tls/tls.crt"
    assert data["TANDEM_TLS_KEY"] == "/etc/tandem/tls/tls.key"
    assert data["TANDEM_TLS_CLIENT_CA"] == "/etc/tandem/client-ca/ca.crt"
    assert data["TANDEM_HEALTH_LISTEN"] == "0.0.0.0:50061"
    pod = build_pod_template(spec, CELL, "scheduler")["spec"]
    assert {"name": "tls", "secret": {"secretName": "demo-tls", "defaultMode": 0o444}} in pod[
        "volumes"]
    assert {"name": "client-ca", "secret": {"secretName": "tenants-ca",
                                            "defaultMode": 0o444}} in pod["volumes"]
    [c] = pod["containers"]
    assert {"name": "tls", "mountPath": "/etc/tandem/tls", "readOnly": True} in c["volumeMounts"]
    assert {"name": "client-ca", "mountPath": "/etc/tandem/client-ca",
            "readOnly": True} in c["volumeMounts"]
    assert c["readinessProbe"]["grpc"]["port"] == 50061, "kubelet probes speak no TLS"
    worker = build_pod_template(spec, CELL, "worker")["spec"]
    assert not [v for v in worker["volumes"] if "secret" in v], "workers never see the key"


def test_tls_only_with_a_secret_and_the_hash_rolls_when_it_is_turned_on() -> None:
    plain, tls = tandem_spec({}), tandem_spec({"tls": {"secretName": "demo-tls"}})
    assert not any(k.startswith("TANDEM_TLS") for k in cell_config(plain, CELL))
    assert "TANDEM_TLS_CLIENT_CA" not in cell_config(tls, CELL)
    assert config_hash(cell_config(plain, CELL)) != config_hash(cell_config(tls, CELL))
    pod = build_pod_template(plain, CELL, "scheduler")["spec"]
    assert not [v for v in pod["volumes"] if "secret" in v]


DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def name_problems(obj: dict[str, Any]) -> list[str]:
    """What the apiserver or a controller would refuse about the names and labels of `obj`,
    and of the pods its controller makes (StatefulSet pods carry `<sts>-<ordinal>` and
    controller-revision-hash=<sts>-<10-character hash>; Job pods job-name=<job>)."""
    kind, meta = obj["kind"], obj["metadata"]
    name, problems = meta["name"], []
    labels = dict(meta.get("labels") or {})
    if kind == "StatefulSet":
        labels["controller-revision-hash"] = f"{name}-{'h' * 10}"
        replicas = obj["spec"]["replicas"]
        labels["statefulset.kubernetes.io/pod-name"] = f"{name}-{replicas - 1}"
    if kind == "Job":
        labels["batch.kubernetes.io/job-name"] = name
    for key, value in labels.items():
        if len(value) > 63 or not LABEL_VALUE.fullmatch(value):
            problems.append(f"{kind} {name}: label {key}={value}")
    pattern = DNS_1035 if kind == "Service" else DNS_LABEL
    if len(name) > 63 or not pattern.fullmatch(name):
        problems.append(f"{kind} {name}: name")
    return problems


def children(spec: Any, cell: Cell) -> list[dict[str, Any]]:
    """Every object the operator makes for `cell`, the routing and the Services included."""
    return [build_configmap(spec, cell), build_statefulset(spec, cell, "scheduler"),
            build_statefulset(spec, cell, "worker"), build_service(spec),
            build_service(spec, headless=True), build_workers_service(spec),
            build_epp_configmap(spec, [cell]), build_epp_deployment(spec, [cell]),
            build_epp_service(spec), build_envoy_configmap(spec, [cell]),
            build_envoy_deployment(spec, [cell]),
            build_cleanup_job(spec, cell.index, cell.node),
            build_cleanup_job(spec, cell.index, cell.node, generation=10 ** 6)]


def test_the_longest_name_the_crd_allows_fits_every_child() -> None:
    """MAX_NAME_LENGTH is tight: one character more and the last cell's scheduler StatefulSet
    makes a controller-revision-hash label longer than 63 (its pods are never created)."""
    spec = tandem_spec({"cells": MAX_CELLS, "worker": {"workersPerCell": 16}},
                       name="n" * MAX_NAME_LENGTH)
    last = Cell(MAX_CELLS - 1, "gpu-1", GI, GI, 10 ** 6)
    assert [p for obj in children(spec, last) for p in name_problems(obj)] == []
    longer = dataclasses.replace(spec, name="n" * (MAX_NAME_LENGTH + 1))
    assert [p.split(":")[1] for obj in children(longer, last) for p in name_problems(obj)] == [
        " label controller-revision-hash=" + f"{'n' * 40}-63-scheduler-{'h' * 10}"]


@pytest.mark.parametrize("patch,grace", [({}, DEFAULT_GRACE_S),
                                         ({"shutdownGraceSeconds": 120}, 120.0),
                                         ({"shutdownGraceSeconds": 0.5}, 0.5)],
                         ids=["default", "long", "short"])
def test_the_shutdown_grace_reaches_every_process_and_its_pod(patch: dict, grace: float) -> None:
    """Issue 22, item 6: each serving process gets TANDEM_SHUTDOWN_GRACE and its pod a
    terminationGracePeriodSeconds that covers it and the stop after it; a worker's grace
    covers its scheduler's (both stop together when a cell stops), so it runs the last step."""
    spec = tandem_spec({"cells": 2, **patch})
    pods = {component: build_pod_template(spec, CELL, component)["spec"]
            for component in ("scheduler", "worker")}
    pods["epp"] = build_epp_deployment(spec, [CELL])["spec"]["template"]["spec"]
    processes = {role: float(env_of(pod["containers"][0])["TANDEM_SHUTDOWN_GRACE"])
                 for role, pod in pods.items()}
    assert processes["scheduler"] == processes["epp"] == grace
    assert processes["worker"] == grace + STOP_MARGIN_S
    for role, pod in pods.items():
        assert pod["terminationGracePeriodSeconds"] >= processes[role] + STOP_MARGIN_S, role
    assert (pods["worker"]["terminationGracePeriodSeconds"]
            > pods["scheduler"]["terminationGracePeriodSeconds"])
    flag = build_parser().parse_args(
        ["worker", "--shutdown-grace", env_of(pods["worker"]["containers"][0])[
            "TANDEM_SHUTDOWN_GRACE"]]).shutdown_grace
    assert flag == processes["worker"]
