"""Gateway and standalone routing (`spec.routing`, operator/tandem_operator/gateway.py): the
InferencePools validate against the Gateway API Inference Extension's v1 CRD (vendored in
tests/data/gie), the endpoint picker's settings are what `tandem epp` reads, a real Envoy
accepts the standalone bootstrap, and switching modes on the API emulator applies and deletes
the right children."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kube_emulator import KubeEmulator
from kube_emulator.cel import rule_failures
from kube_emulator.fixtures import CRD_PATH, GIE_CRD_PATH, REPO, tandem_spec
from kube_emulator.schema import apply_defaults, load_crd, validation_errors, version_schema
from pki import make_pki
from test_chart_harness import (
    NAMESPACE,
    helm_fixture,  # noqa: F401 (registers the session fixture `helm`)
    one,
    render,
)

from router_svc.pool_watch import PoolSource
from tandem_cli import cli
from tandem_cli.gateway import envoy_binary
from tandem_operator.front import cell_address
from tandem_operator.gateway import (
    EPP_PORT,
    build_envoy_configmap,
    build_envoy_deployment,
    build_epp_configmap,
    build_epp_deployment,
    build_epp_role,
    build_epp_role_binding,
    build_epp_service,
    build_epp_service_account,
    build_inference_pool,
    epp_config,
    pools,
)
from tandem_operator.kube import KubeApi
from tandem_operator.manifests import HEALTH_PORT
from tandem_operator.placement import Cell
from tandem_operator.reconcile import Front, apply_services
from tandem_operator.spec import parse_spec
from tandem_operator.workloads import build_pod_template

POOL_SCHEMA = version_schema(load_crd(GIE_CRD_PATH), "v1")
CELLS = [Cell(index=i, node=f"gpu-{i}", cache_bytes=0, requested_bytes=0, generation=0,
              reason="") for i in range(3)]
TLS = {"tls": {"secretName": "demo-tls", "clientCASecretName": "demo-ca"}}


def gateway(patch: dict[str, Any] | None = None) -> Any:
    return tandem_spec({"cells": 3, "routing": {"mode": "gateway"}, **(patch or {})})


def all_pools(spec: Any) -> list[dict[str, Any]]:
    return [build_inference_pool(spec, *p) for p in pools(spec)]


def pool_problems(pool: dict[str, Any]) -> list[str]:
    """What an apiserver with the GIE CRD refuses: the schema (unknown fields included,
    which it would drop silently) and the CRD's CEL rules."""
    return [*validation_errors(POOL_SCHEMA, pool, strict=True),
            *(str(f) for f in rule_failures(POOL_SCHEMA, pool))]


@pytest.mark.parametrize("patch", [{}, {"http": {"enabled": False}},
                                   {"routing": {"mode": "gateway", "failureMode": "FailOpen"}},
                                   TLS, {"scheduler": {"port": 7000}, "http": {"port": 7001}}])
def test_every_rendered_pool_validates_against_the_gie_v1_crd(patch: dict[str, Any]) -> None:
    spec = gateway(patch)
    for pool in all_pools(spec):
        assert pool_problems(pool) == [], pool
    # The check can fail: a misspelt field, a missing port, an unknown protocol.
    pool = all_pools(spec)[0]
    for broken in ({**pool, "spec": {**pool["spec"], "endpointPickerRefs": {}}},
                   {**pool, "spec": {**pool["spec"], "targetPorts": []}},
                   {**pool, "spec": {**pool["spec"], "appProtocol": "grpc"}}):
        assert pool_problems(broken)


def test_the_charts_gateway_values_reach_the_pools_and_the_epp(helm: dict) -> None:
    """`service.routing` through `helm template` and the CRD's defaults to what the operator
    renders: valid pools and a picker with the chart's replicas."""
    objects = render("helm4", (), ("service.cells=2", 'service.routing.mode="gateway"',
                                   'service.routing.failureMode="FailOpen"',
                                   "service.routing.epp.replicas=2"))
    service = one(objects, "TandemService")
    apply_defaults(load_crd(CRD_PATH)["spec"]["versions"][0]["schema"]["openAPIV3Schema"],
                   service)
    spec = parse_spec(service["metadata"]["name"], NAMESPACE, service["spec"])
    assert spec.picked and spec.front == "scheduler"
    for pool in all_pools(spec):
        assert pool_problems(pool) == []
        assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert build_epp_deployment(spec, CELLS[:2])["spec"]["replicas"] == 2


def test_one_pool_per_protocol_selects_the_schedulers_and_names_the_epp() -> None:
    spec = gateway({"routing": {"mode": "gateway", "failureMode": "FailOpen"}})
    grpc, http = all_pools(spec)
    assert (grpc["metadata"]["name"], grpc["spec"]["appProtocol"],
            grpc["spec"]["targetPorts"]) == ("demo-grpc", "kubernetes.io/h2c", [{"number": 50051}])
    assert (http["metadata"]["name"], http["spec"]["appProtocol"],
            http["spec"]["targetPorts"]) == ("demo-http", "http", [{"number": 8000}])
    scheduler_pod = build_pod_template(spec, CELLS[0], "scheduler")["metadata"]["labels"]
    worker_pod = build_pod_template(spec, CELLS[0], "worker")["metadata"]["labels"]
    service = build_epp_service(spec)
    for pool in (grpc, http):
        selector = pool["spec"]["selector"]["matchLabels"]
        assert selector.items() <= scheduler_pod.items()
        assert not selector.items() <= worker_pod.items()
        ref = pool["spec"]["endpointPickerRef"]
        assert ref["name"] == service["metadata"]["name"] == "demo-epp"
        assert ref["port"]["number"] == service["spec"]["ports"][0]["port"] == EPP_PORT
        assert ref["failureMode"] == "FailOpen"
    assert scheduler_pod["inference.networking.k8s.io/engine-type"] == "vllm"
    assert "inference.networking.k8s.io/engine-type" not in worker_pod
    assert [p["metadata"]["name"] for p in all_pools(gateway({"http": {"enabled": False}}))] == [
        "demo-grpc"]


def epp_settings(data: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """What the real `tandem epp` makes of a ConfigMap's settings (its env); a kubeconfig
    stands in for the pod's service account (`--pool` finds credentials at once)."""
    for key in ("TANDEM_EPP_CELLS", "TANDEM_EPP_POOL", "TANDEM_EPP_HTTP_POOL"):
        monkeypatch.delenv(key, raising=False)  # an earlier call's
    for key, value in data.items():
        monkeypatch.setenv(key, value)
    kubeconfig = REPO / "tests" / "data" / "kubeconfig.yaml"
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    args = cli.build_parser().parse_args(["epp"])
    return cli._epp_config(args, args.listen)


def test_tandem_epp_reads_the_rendered_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = gateway({"routing": {"mode": "gateway", "loadFactor": 1.5},
                    "prefixCache": {"blockSize": 32}})
    data = build_epp_configmap(spec, CELLS)["data"]
    assert "TANDEM_EPP_CELLS" not in data  # gateway mode: the cells are the pools' pods
    config = epp_settings(data, monkeypatch)
    assert config.pool == PoolSource("demo-grpc", "demo-http") and config.cells == ()
    assert (config.listen, config.load_factor, config.block_size) == ("0.0.0.0:9002", 1.5, 32)
    assert config.health_listen == f"0.0.0.0:{HEALTH_PORT}" and config.metrics_port == 9400
    no_http = build_epp_configmap(gateway({"http": {"enabled": False}}), CELLS)["data"]
    assert (no_http["TANDEM_EPP_POOL"], "TANDEM_EPP_HTTP_POOL" in no_http) == ("demo-grpc", False)
    # Standalone mode renders no pool: the EPP is told the recorded cells.
    data = build_epp_configmap(standalone(), CELLS)["data"]
    assert data["TANDEM_EPP_CELLS"].split(",") == [f"{cell_address(spec, c.index)}/8000"
                                                   for c in CELLS]
    assert "TANDEM_EPP_POOL" not in data
    config = epp_settings(data, monkeypatch)
    assert [(c.host, c.grpc_port, c.http_port) for c in config.cells] == [
        (f"demo-{i}-scheduler-0.demo-headless.serving.svc", 50051, 8000) for i in range(3)]


def test_the_gateway_epp_watches_with_an_account_that_may_only_list_and_watch() -> None:
    spec = gateway()
    pod = build_epp_deployment(spec, CELLS)["spec"]["template"]["spec"]
    account = build_epp_service_account(spec)["metadata"]
    assert pod["serviceAccountName"] == account["name"] == "demo-epp"
    role, binding = build_epp_role(spec), build_epp_role_binding(spec)
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "serving"
    assert {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
            for r in rule["resources"] for v in rule["verbs"]} == {
        ("", "pods", "list"), ("", "pods", "watch"),
        ("inference.networking.k8s.io", "inferencepools", "list"),
        ("inference.networking.k8s.io", "inferencepools", "watch")}
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-epp",
                                    "namespace": "serving"}]
    standalone_pod = build_epp_deployment(standalone(), CELLS)["spec"]["template"]["spec"]
    assert "serviceAccountName" not in standalone_pod


def test_a_tls_epp_serves_with_the_secret_and_trusts_the_cells_ca(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = gateway(TLS)
    config = epp_settings(build_epp_configmap(spec, CELLS)["data"], monkeypatch)
    assert (config.tls.cert, config.tls.key, config.tls.ca) == (
        "/etc/tandem/tls/tls.crt", "/etc/tandem/tls/tls.key", "/etc/tandem/client-ca/ca.crt")
    assert (config.cell_tls.ca, config.cell_tls.cert, config.cell_tls.key) == (
        "/etc/tandem/tls/ca.crt", "/etc/tandem/tls/tls.crt", "/etc/tandem/tls/tls.key")
    pod = build_epp_deployment(spec, CELLS)["spec"]["template"]["spec"]
    assert {v["name"] for v in pod["volumes"]} == {"tmp", "tls", "client-ca"}
    assert build_epp_service(spec)["spec"]["ports"][0]["appProtocol"] == "https"


def test_the_epp_deployment_runs_tandem_epp_probed_on_liveness_and_readiness() -> None:
    spec = gateway({"routing": {"mode": "gateway", "epp": {"replicas": 2}}})
    dep = build_epp_deployment(spec, CELLS)
    assert dep["metadata"]["name"] == "demo-epp" and dep["spec"]["replicas"] == 2
    [c] = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["tandem", "epp"] and c["image"] == spec.scheduler.image
    assert c["envFrom"] == [{"configMapRef": {"name": "demo-epp"}}]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "ext-proc": EPP_PORT, "health": HEALTH_PORT, "metrics": 9400}
    assert c["livenessProbe"]["grpc"] == {"port": HEALTH_PORT, "service": "liveness"}
    assert c["readinessProbe"]["grpc"] == {"port": HEALTH_PORT, "service": "readiness"}
    assert c["securityContext"]["readOnlyRootFilesystem"]
    key = "tandem.dev/config-hash"
    assert (dep["spec"]["template"]["metadata"]["annotations"][key]
            == build_epp_configmap(spec, CELLS)["metadata"]["annotations"][key])


def standalone(patch: dict[str, Any] | None = None) -> Any:
    return tandem_spec({"cells": 3, "routing": {"mode": "standalone", **(patch or {})}})


def test_a_real_envoy_accepts_the_standalone_bootstrap(tmp_path: Path) -> None:
    for spec in (standalone(), standalone({"failureMode": "FailOpen"})):
        bootstrap = json.loads(build_envoy_configmap(spec, CELLS)["data"]["envoy.json"])
        listeners = bootstrap["static_resources"]["listeners"]
        assert [ls["address"]["socket_address"]["port_value"] for ls in listeners] == [
            50051, 8000]
        clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
        epp = clusters["tandem-epp"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
        assert epp["endpoint"]["address"]["socket_address"] == {
            "address": "demo-epp.serving.svc", "port_value": EPP_PORT}
        path = tmp_path / "envoy.json"
        path.write_text(json.dumps(bootstrap))
        done = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(path)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    dep = build_envoy_deployment(standalone({"envoy": {"image": "mirror/envoy:v1.40.0"}}),
                                 CELLS)
    [c] = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "mirror/envoy:v1.40.0"
    assert {p["name"] for p in c["ports"]} == {"grpc", "http"}, "the Service's target ports"


def test_standalone_envoy_knows_each_cell_by_its_pods_name() -> None:
    """Failover and x-tandem-cell: Envoy reaches each cell where the EPP names it (its pod's
    address) and calls it what the EPP calls it."""
    spec = standalone()
    bootstrap = json.loads(build_envoy_configmap(spec, CELLS[:2])["data"]["envoy.json"])
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    names = epp_config(spec, CELLS[:2])["TANDEM_EPP_CELLS"].split(",")  # host:grpc/http
    for cluster, port in (("tandem-cells-grpc", 50051), ("tandem-cells-http", 8000)):
        endpoints = clusters[cluster]["load_assignment"]["endpoints"][0]["lb_endpoints"]
        assert [(e["endpoint"]["address"]["socket_address"],
                 e["metadata"]["filter_metadata"]["tandem"]["name"]) for e in endpoints] == [
            ({"address": n.rpartition(":")[0], "port_value": port}, n.partition("/")[0])
            for n in names]
    assert names[1].startswith("demo-1-scheduler-0.demo-headless.serving.svc:")
    routes = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    # routes[0]: the admin calls, to the picker; then the picked cells, retried.
    assert routes[1]["route"]["retry_policy"]["num_retries"] == 1  # two cells


def test_standalone_with_tls_serves_it_and_reaches_the_picker_over_it(tmp_path: Path) -> None:
    """As every public port under `tls` (and as the removed router did): the listeners serve
    the Secret's certificate and require the client CA's certificates; the picker and the
    cells are reached over TLS. A real Envoy accepts it, with the Secrets' files where the
    pod mounts them."""
    spec = tandem_spec({"cells": 3, **TLS})
    text = build_envoy_configmap(spec, CELLS)["data"]["envoy.json"]
    bootstrap = json.loads(text)
    for listener in bootstrap["static_resources"]["listeners"]:
        [chain] = listener["filter_chains"]
        tls = chain["transport_socket"]["typed_config"]
        assert tls["require_client_certificate"]
        context = tls["common_tls_context"]
        assert context["tls_certificates"] == [{
            "certificate_chain": {"filename": "/etc/tandem/tls/tls.crt"},
            "private_key": {"filename": "/etc/tandem/tls/tls.key"}}]
        assert context["validation_context"]["trusted_ca"] == {
            "filename": "/etc/tandem/client-ca/ca.crt"}
    [epp] = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "tandem-epp"]
    upstream = epp["transport_socket"]["typed_config"]
    assert upstream["sni"] == "demo-epp.serving.svc"
    assert upstream["common_tls_context"]["validation_context"]["trusted_ca"] == {
        "filename": "/etc/tandem/tls/ca.crt"}
    # The cells too: they serve the same certificate and ask for the client CA's.
    for cells in (c for c in bootstrap["static_resources"]["clusters"]
                  if c["name"].startswith("tandem-cells")):
        context = cells["transport_socket"]["typed_config"]["common_tls_context"]
        assert context["validation_context"]["trusted_ca"] == {
            "filename": "/etc/tandem/tls/ca.crt"}
        assert context["tls_certificates"][0]["certificate_chain"] == {
            "filename": "/etc/tandem/tls/tls.crt"}
    pod = build_envoy_deployment(spec, CELLS)["spec"]["template"]["spec"]
    assert {v["name"] for v in pod["volumes"]} == {"tmp", "envoy", "tls", "client-ca"}
    pki = make_pki(tmp_path)
    files = {"/etc/tandem/tls/tls.crt": pki.server_cert, "/etc/tandem/tls/tls.key":
             pki.server_key, "/etc/tandem/tls/ca.crt": pki.ca,
             "/etc/tandem/client-ca/ca.crt": pki.ca}
    for mounted, local in files.items():
        text = text.replace(mounted, str(local))
    path = tmp_path / "envoy.json"
    path.write_text(text)
    done = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    plain = json.loads(build_envoy_configmap(standalone(), CELLS)["data"]["envoy.json"])
    assert all("transport_socket" not in ls["filter_chains"][0]
               for ls in plain["static_resources"]["listeners"])


def test_the_routing_mode_decides_the_front() -> None:
    assert tandem_spec({"cells": 3}).routing.mode == "standalone"
    assert Front.wanted(tandem_spec({"cells": 3}), CELLS) == Front("envoy", (0, 1, 2))
    assert Front.wanted(gateway(), CELLS) == Front("scheduler", (0, 1, 2))
    assert Front.wanted(standalone(), CELLS) == Front("envoy", (0, 1, 2))
    assert Front.wanted(tandem_spec({"routing": {"mode": "gateway"}}), CELLS[:1]) == Front(
        "scheduler", (0,)), "one cell: the pools and the EPP still serve the gateway"


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeApi]:
    emulator = KubeEmulator([CRD_PATH, GIE_CRD_PATH])
    emulator.start()
    config = kubernetes.client.Configuration()
    kubeconfig = emulator.write_kubeconfig(tmp_path_factory.mktemp("gie") / "kubeconfig")
    kubernetes.config.load_kube_config(str(kubeconfig), client_configuration=config)
    api = KubeApi(kubernetes.client.ApiClient(config))
    try:
        yield api
    finally:
        api.close()
        emulator.stop()


def children(kube: KubeApi) -> dict[str, list[str]]:
    selector = "app.kubernetes.io/instance=demo"
    return {kind: sorted(o["metadata"]["name"] for o in asyncio.run(
                kube.list(kind, "serving", selector)))
            for kind in ("Deployment", "ConfigMap", "Service", "InferencePool")}


def test_switching_modes_applies_and_deletes_the_routing_children(kube: KubeApi) -> None:
    owner = {"apiVersion": "tandem.dev/v1alpha1", "kind": "TandemService",
             "metadata": {"name": "demo", "namespace": "serving", "uid": "u-1"}}
    services = ["demo", "demo-headless", "demo-workers"]

    def switch(mode: str, patch: dict[str, Any] | None = None) -> str:
        """Apply the mode; the component the Service selects (the emulator's Deployment
        controller makes a Deployment available at once)."""
        spec = tandem_spec({"cells": 3, "routing": {"mode": mode}, **(patch or {})})
        front = asyncio.run(apply_services(kube, owner, spec, CELLS))
        assert front == Front.wanted(spec, CELLS)
        service = asyncio.run(kube.read("Service", "serving", "demo"))
        assert service is not None
        selected: str = service["spec"]["selector"]["app.kubernetes.io/component"]
        return selected

    # What an earlier operator version ran in front of the cells: gone on the first pass.
    legacy = [{"apiVersion": api, "kind": kind, "metadata": {
        "name": "demo-router", "namespace": "serving",
        "labels": {"app.kubernetes.io/instance": "demo"}}, **extra}
        for api, kind, extra in (("v1", "ConfigMap", {"data": {}}), ("apps/v1", "Deployment", {
            "spec": {"selector": {"matchLabels": {"app": "r"}}, "template": {
                "metadata": {"labels": {"app": "r"}},
                "spec": {"containers": [{"name": "router", "image": "tandem"}]}}}}))]
    for obj in legacy:
        asyncio.run(kube.apply(obj))
    assert children(kube)["Deployment"] == ["demo-router"]
    assert switch("router") == "envoy", "the deprecated alias runs standalone"
    standalone_children = {"Deployment": ["demo-envoy", "demo-epp"],
                           "ConfigMap": ["demo-envoy", "demo-epp"],
                           "Service": sorted([*services, "demo-epp"]), "InferencePool": []}
    assert children(kube) == standalone_children
    assert switch("gateway") == "scheduler"
    assert children(kube) == {"Deployment": ["demo-epp"], "ConfigMap": ["demo-epp"],
                              "Service": sorted([*services, "demo-epp"]),
                              "InferencePool": ["demo-grpc", "demo-http"]}
    picker_account = ("ServiceAccount", "Role", "RoleBinding")
    assert all(asyncio.run(kube.read(kind, "serving", "demo-epp")) for kind in picker_account)
    switch("gateway", {"http": {"enabled": False}})
    assert children(kube)["InferencePool"] == ["demo-grpc"]
    assert switch("standalone") == "envoy"
    assert not any(asyncio.run(kube.read(kind, "serving", "demo-epp"))
                   for kind in picker_account)
    assert children(kube) == standalone_children
    assert switch("standalone", {"cells": 1}) == "scheduler", "one cell: nothing in front"
    assert children(kube) == {"Deployment": [], "ConfigMap": [], "Service": services,
                              "InferencePool": []}
