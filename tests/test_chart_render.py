"""The chart, rendered by real Helm 3 and Helm 4: lint, schema validity of every object, and the
properties that matter when it runs (security contexts, probes, tracing wiring, pass-through).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer
from kube_emulator.schema import apply_defaults
from pki import make_pki
from test_chart_harness import (
    ALL_ON,
    ALL_ON_SETS,
    CHART,
    CI_VALUES,
    CRD_SCHEMA,
    KUBE_VERSIONS,
    MAJORS,
    NAMESPACE,
    RELEASE,
    RenderError,
    env_of,
    find,
    helm_fixture,  # noqa: F401 (registers the session fixture `helm`)
    one,
    pod_specs,
    render,
    render_text,
    run_helm,
    validate_object,
)

from tandem import __version__
from tandem.shutdown import DEFAULT_GRACE_S, STOP_MARGIN_S
from tandem_cli.cli import build_parser
from tandem_operator.main import parser as operator_parser
from tandem_operator.manifests import build_service, cell_config, endpoint
from tandem_operator.placement import Cell
from tandem_operator.spec import TandemSpec, parse_spec
from tandem_operator.workloads import build_pod_template
from tandem_testing.cells import free_port, running_cell

CASES = [(), *((v,) for v in CI_VALUES)]
MONITORING = "monitoring.podMonitor.enabled=true"
CASE_IDS = ["default", *(v.removeprefix("ci/").removesuffix("-values.yaml") for v in CI_VALUES)]


def test_ci_covers_the_required_modes() -> None:
    assert {"ci/tracing-values.yaml", "ci/cells-values.yaml", "ci/node-model-values.yaml",
            "ci/watch-namespaces-values.yaml"} <= set(CI_VALUES)


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize("values", CASES, ids=CASE_IDS)
def test_lint_strict(helm: dict, major: str, values: tuple[str, ...]) -> None:
    flags = [f for v in values for f in ("-f", str(CHART / v))]
    proc = run_helm(major, "lint", "--strict", str(CHART), "--namespace", NAMESPACE, *flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize("values", [*CASES, ALL_ON], ids=[*CASE_IDS, "all-on"])
def test_every_object_validates(helm: dict, major: str, values: tuple[str, ...]) -> None:
    sets = ALL_ON_SETS if values == ALL_ON else ()
    objects = render(major, values, sets)
    assert objects
    for obj in objects:
        for version in KUBE_VERSIONS:
            validate_object(obj, version)


@pytest.mark.parametrize("values", [*CASES, ALL_ON], ids=[*CASE_IDS, "all-on"])
def test_tandemservice_is_served_by_the_operator(helm: dict, values: tuple[str, ...]) -> None:
    """After the apiserver's defaulting, the operator's own parser accepts the chart's object
    (it also applies the rules the CRD states in CEL). The namespaced mode renders none."""
    objects = render("helm4", values, ALL_ON_SETS if values == ALL_ON else ())
    services = find(objects, "TandemService")
    if values == ("ci/watch-namespaces-values.yaml",):
        assert not services
        return
    (service,) = services
    apply_defaults(CRD_SCHEMA, service)
    parsed = parse_spec(service["metadata"]["name"], NAMESPACE, service["spec"])
    assert parsed.scheduler.image == f"ghcr.io/tandem-dev/tandem:{__version__}"


def test_helm3_and_helm4_render_the_same_objects(helm: dict) -> None:
    for values in CASES:
        assert render("helm3", values) == render("helm4", values), values


def test_default_install_serves_a_gpu_pair(helm: dict) -> None:
    objects = render("helm4")
    spec = one(objects, "TandemService")["spec"]
    assert spec["cells"] == 1 and spec["worker"]["gpu"] == {"count": 1,
                                                           "resourceName": "nvidia.com/gpu"}
    assert spec["image"] == {"repository": "ghcr.io/tandem-dev/tandem", "tag": __version__,
                             "pullPolicy": "IfNotPresent"}
    assert spec["featureCache"]["type"] == "shm"
    operator = one(objects, "Deployment", "operator")
    assert operator["spec"]["template"]["spec"]["containers"][0]["image"] == (
        f"ghcr.io/tandem-dev/tandem-operator:{__version__}")
    assert not find(objects, "Deployment", "collector") and not find(objects, "PodMonitor")


@pytest.mark.parametrize("values", [*CASES, ALL_ON], ids=[*CASE_IDS, "all-on"])
def test_pods_are_locked_down(helm: dict, values: tuple[str, ...]) -> None:
    sets = ALL_ON_SETS if values == ALL_ON else ()
    for name, pod in pod_specs(render("helm4", values, sets)):
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in pod.get("initContainers", []) + pod["containers"]:
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert ctx["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert ctx["capabilities"] == {"drop": ["ALL"]}, (name, c["name"])
            assert "memory" in c["resources"]["limits"], (name, c["name"])
            repository, _, tag = c["image"].rpartition(":")
            assert repository and tag not in ("", "latest"), c["image"]


def test_operator_deployment(helm: dict) -> None:
    deployment = one(render("helm4"), "Deployment", "operator")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["tandem"]
    assert container["args"] == ["operator", "--liveness=http://0.0.0.0:8080/healthz"]
    probe = container["livenessProbe"]
    assert probe["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
    assert probe["failureThreshold"] >= 3, "a lenient liveness probe"
    assert pod["serviceAccountName"] == one(render("helm4"), "ServiceAccount", "operator")[
        "metadata"]["name"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_operator_watches_the_listed_namespaces(helm: dict) -> None:
    objects = render("helm4", ("ci/watch-namespaces-values.yaml",))
    args = one(objects, "Deployment", "operator")["spec"]["template"]["spec"]["containers"][0][
        "args"]
    assert args[2:] == ["--namespace=team-a", "--namespace=team-b", "--verbose"]
    options = operator_parser().parse_args(args[1:])
    assert options.namespace == ["team-a", "team-b"] and options.peering is None


def test_commands_parse_with_the_tandem_cli(helm: dict) -> None:
    """Every container that runs `tandem` passes arguments the real CLI accepts (for
    `tandem operator`, both the command line and the operator's own options)."""
    parser = build_parser()
    seen = set()
    for _, pod in pod_specs(render("helm4", ALL_ON, ALL_ON_SETS)):
        for c in pod.get("initContainers", []) + pod["containers"]:
            if c.get("command") == ["tandem"]:
                seen.add(c["args"][0])
                if c["args"][0] == "operator":  # main() hands these to the operator's parser
                    assert operator_parser().parse_args(c["args"][1:]).liveness == (
                        "http://0.0.0.0:8080/healthz")
                else:
                    assert callable(parser.parse_args(c["args"]).func)
    assert seen == {"operator", "generate"}


def operator_view(objects: list[dict]) -> tuple[TandemSpec, dict, dict]:
    """The chart's TandemService as the operator serves it: (spec, scheduler pod, Service)."""
    service = one(objects, "TandemService")
    apply_defaults(CRD_SCHEMA, service)
    spec = parse_spec(service["metadata"]["name"], NAMESPACE, service["spec"])
    cell = Cell(index=0, node="node-a", cache_bytes=1 << 30, requested_bytes=1 << 30,
                generation=1)
    return spec, build_pod_template(spec, cell, "scheduler"), build_service(spec)


def test_helm_test_checks_health_then_generates(helm: dict) -> None:
    objects = render("helm4")
    spec, _, service = operator_view(objects)
    pod = one(objects, "Pod", "test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    # The Service the operator creates for the chart's TandemService, on its Generate port.
    target = f"{service['metadata']['name']}.{NAMESPACE}.svc:{service['spec']['ports'][0]['port']}"
    assert endpoint(spec) == f"dns:///{target}"
    (health,) = pod["spec"]["initContainers"]
    assert health["command"][:2] == ["python", "-c"] and health["command"][-1] == target
    compile(health["command"][2], "health-check", "exec")
    assert "tandem.v1.Generation" in health["command"][2]
    generate, openai = pod["spec"]["containers"]
    assert generate["args"] == ["generate", "--target", target, "--max-tokens", "4", "hello"]
    # ... and the OpenAI-compatible API on the Service's http port
    http = next(p for p in service["spec"]["ports"] if p["name"] == "http")
    host = f"{service['metadata']['name']}.{NAMESPACE}.svc"
    assert openai["command"][:2] == ["python", "-c"]
    assert openai["command"][3:] == [f"http://{host}:{http['port']}"]
    compile(openai["command"][2], "openai-check", "exec")
    assert len(one(render("helm4", (), ("service.http.enabled=false",)), "Pod", "test")[
        "spec"]["containers"]) == 1


def test_helm_test_http_script_completes_against_a_real_cell(helm: dict,
                                                             tmp_path: Path) -> None:
    """The openai container's script, run for real against ``tandem serve``'s HTTP port."""
    script = one(render("helm4"), "Pod", "test")["spec"]["containers"][1]["command"][2]
    port = free_port()
    with running_cell(tmp_path, "--http-listen", f"127.0.0.1:{port}"):
        out = subprocess.run([sys.executable, "-c", script, f"http://127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    # The script samples (OpenAI's default temperature, 1): the tiny random model ends with
    # EOS before its 4 tokens in ~1% of requests (measured: 4 of 400), which made `== 4` a
    # flake (a fresh CI run got 1 token).
    answer = json.loads(out.stdout)
    tokens, finish = answer["usage"]["completion_tokens"], answer["choices"][0]["finish_reason"]
    assert 1 <= tokens <= 4 and finish == ("length" if tokens == 4 else "stop"), answer


def test_helm_test_health_script_waits_for_serving(helm: dict) -> None:
    """The init container's script, run for real against a gRPC health server that turns
    SERVING only after the script's first check: it keeps polling, then exits 0."""
    script = one(render("helm4"), "Pod", "test")["spec"]["initContainers"][0]["command"][2]
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    health = HealthServicer()
    health.set("tandem.v1.Generation", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        proc = subprocess.Popen([sys.executable, "-c", script, f"127.0.0.1:{port}"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        first = proc.stdout.readline()  # printed after the first (NOT_SERVING) answer
        health.set("tandem.v1.Generation", health_pb2.HealthCheckResponse.SERVING)
        rest, _ = proc.communicate(timeout=60)
    finally:
        server.stop(grace=None)
    assert proc.returncode == 0, first + rest
    assert first.endswith("tandem.v1.Generation NOT_SERVING\n"), first + rest
    assert rest.splitlines()[-1].endswith("tandem.v1.Generation SERVING"), first + rest


def test_podmonitor_scrapes_the_operators_pods(helm: dict) -> None:
    objects = render("helm4", (), (MONITORING,))
    _, pod, _ = operator_view(objects)
    monitor = one(objects, "PodMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
    assert {e["port"] for e in monitor["podMetricsEndpoints"]} <= ports
    env = {e["name"] for c in pod["spec"]["containers"] for e in c["env"]}
    assert "TANDEM_METRICS_PORT" in env


def test_image_user_owns_the_segment(helm: dict) -> None:
    """The operator hands the segment directory to the pods' user: the image's user."""
    spec, pod, _ = operator_view(render("helm4"))
    assert (spec.run_as_user, spec.run_as_group) == (10001, 10001)
    assert pod["spec"]["securityContext"]["runAsUser"] == 10001


def test_hook_scripts_compile(helm: dict) -> None:
    objects = render("helm4", ALL_ON, ALL_ON_SETS)
    scripts = [c["command"][2] for _, pod in pod_specs(objects) for c in pod["containers"]
               if c.get("command", [])[:2] == ["python", "-c"]]
    # label the namespace, delete the TandemService on uninstall, helm test's HTTP call
    assert len(scripts) == 3
    for script in scripts:
        compile(script, "hook", "exec")


def test_operator_image_runs_the_operator_and_the_hook_jobs(helm: dict) -> None:
    """The slim operator image (no torch) runs the operator and the Jobs, whose scripts import
    only the standard library and the kubernetes client; helm test's pods run the full image."""
    objects = render("helm4", ALL_ON, (*ALL_ON_SETS, 'operator.image.tag="7.0.0"'))
    slim = [one(objects, "Deployment", "operator"), *find(objects, "Job")]
    assert len(slim) == 3, "the operator, the Pod Security and the uninstall hooks"
    for obj in slim:
        for c in obj["spec"]["template"]["spec"]["containers"]:
            assert c["image"] == "ghcr.io/tandem-dev/tandem-operator:7.0.0", obj["metadata"]
            if c.get("command", [])[:2] != ["python", "-c"]:
                continue
            imported = set()
            for node in ast.walk(ast.parse(c["command"][2])):
                if isinstance(node, ast.Import):
                    imported |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom):
                    imported.add((node.module or "").split(".")[0])
            assert imported - sys.stdlib_module_names == {"kubernetes"}, imported
    tests = [c["image"] for pod in find(objects, "Pod") for c in pod["spec"]["containers"]]
    assert tests and set(tests) == {f"ghcr.io/tandem-dev/tandem:{__version__}"}, tests


def _endpoint_env(objects: list[dict]) -> str:
    container = one(objects, "Deployment", "operator")["spec"]["template"]["spec"]["containers"][0]
    return env_of(container).get("OTEL_EXPORTER_OTLP_ENDPOINT", "")


@pytest.mark.parametrize(("sets", "expected"), [
    ((), ""),
    (('tracing.endpoint="http://otel.monitoring:4317"',), "http://otel.monitoring:4317"),
    (("tracing.jaeger.enabled=true",), f"http://tandem-jaeger.{NAMESPACE}.svc:4317"),
    (("tracing.collector.enabled=true", "tracing.jaeger.enabled=true"),
     f"http://tandem-collector.{NAMESPACE}.svc:4317"),
], ids=["off", "endpoint", "jaeger", "collector"])
def test_tracing_endpoint_reaches_every_component(helm: dict, sets: tuple, expected: str) -> None:
    objects = render("helm4", (), sets)
    assert _endpoint_env(objects) == expected
    assert one(objects, "TandemService")["spec"]["tracing"]["endpoint"] == expected
    container = one(objects, "Deployment", "operator")["spec"]["template"]["spec"]["containers"][0]
    env = env_of(container)
    assert env["OTEL_SERVICE_NAME"] == "tandem-operator"
    assert "k8s.pod.name=$(POD_NAME)" in env["OTEL_RESOURCE_ATTRIBUTES"]
    assert ("OTEL_TRACES_SAMPLER" in env) == bool(expected)


def test_collector_forwards_to_jaeger_and_upstream(helm: dict) -> None:
    objects = render("helm4", ("ci/tracing-values.yaml",))
    config = yaml.safe_load(one(objects, "ConfigMap", "collector")["data"]["config.yaml"])
    exporters = config["exporters"]
    assert exporters["otlp_grpc/jaeger"]["endpoint"] == (
        f"http://tandem-jaeger.{NAMESPACE}.svc:4317")
    assert exporters["otlp_grpc/upstream"]["endpoint"] == "http://otel-gateway.monitoring.svc:4317"
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    assert set(pipeline["exporters"]) == set(exporters)
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    service = one(objects, "TandemService")["spec"]["tracing"]
    assert service == {"endpoint": f"http://tandem-collector.{NAMESPACE}.svc:4317",
                       "sampler": "parentbased_always_on", "ratio": "1"}


def test_services_select_their_pods(helm: dict) -> None:
    """Each Service's selector matches the pods of exactly one workload, on a declared port."""
    objects = render("helm4", ALL_ON, ALL_ON_SETS)
    services = find(objects, "Service")
    assert {s["metadata"]["name"] for s in services} == {"tandem-collector", "tandem-jaeger"}
    for service in services:
        selector = service["spec"]["selector"].items()
        pods = [o["spec"]["template"] for o in find(objects, "Deployment")
                if selector <= o["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pods) == 1, service["metadata"]["name"]
        names = {p["name"] for c in pods[0]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names
    for deployment in find(objects, "Deployment"):
        template_labels = deployment["spec"]["template"]["metadata"]["labels"].items()
        assert deployment["spec"]["selector"]["matchLabels"].items() <= template_labels
        assert "app.kubernetes.io/version" not in deployment["spec"]["selector"]["matchLabels"]


def test_tandemservice_needs_a_served_namespace(helm: dict) -> None:
    """A TandemService the operator would never see is refused at install time."""
    with pytest.raises(RenderError, match="leaves out"):
        render_text("helm4", (), ('operator.watchNamespaces=["team-a"]',))
    served = render("helm4", (), (f'operator.watchNamespaces=["team-a","{NAMESPACE}"]',))
    assert one(served, "TandemService")["metadata"]["namespace"] == NAMESPACE


def test_pass_through_blocks(helm: dict) -> None:
    objects = render("helm4", ("ci/watch-namespaces-values.yaml",), (
        'imagePullSecrets=[{"name":"regcred"}]',
        'operator.affinity={"nodeAffinity":{"preferredDuringSchedulingIgnoredDuringExecution":'
        '[{"weight":1,"preference":{"matchExpressions":[{"key":"a","operator":"Exists"}]}}]}}'))
    pod = one(objects, "Deployment", "operator")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["tolerations"] == [{"key": "CriticalAddonsOnly", "operator": "Exists"}]
    assert pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert env_of(container)["OTEL_EXPORTER_OTLP_CERTIFICATE"] == "/etc/ssl/cluster-ca/ca.crt"
    assert {"name": "ca", "configMap": {"name": "cluster-ca"}} in pod["volumes"]
    assert {"name": "ca", "mountPath": "/etc/ssl/cluster-ca", "readOnly": True} in container[
        "volumeMounts"]
    for _, hook_pod in pod_specs(objects):
        assert hook_pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_cells_mode_reaches_the_tandemservice(helm: dict) -> None:
    spec = one(render("helm4", ("ci/cells-values.yaml",)), "TandemService")["spec"]
    assert spec["cells"] == 3 and spec["worker"]["workersPerCell"] == 2
    assert spec["model"] == {"name": "custom", "path": "/models/Qwen2-VL-2B-Instruct",
                             "claimName": "tandem-models", "subPath": "Qwen2-VL-2B-Instruct"}
    assert spec["placement"]["maxCellsPerNode"] == 2
    assert spec["placement"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert spec["scheduler"]["env"] == [{"name": "TANDEM_MAX_NUM_SEQS", "value": "32"}]
    assert spec["image"]["pullSecrets"] == ["regcred"]
    assert spec["tls"] == {"secretName": "demo-tls", "clientCASecretName": "tenants-ca"}
    assert spec["worker"]["tensorParallelSize"] == 2
    assert "router" not in spec
    assert (spec["routing"]["envoy"]["replicas"], spec["routing"]["loadFactor"]) == (2, 1.5)
    assert spec["routing"]["mode"] == "standalone"


@pytest.mark.parametrize("values,volume,sub_path", [
    ("ci/cells-values.yaml", {"persistentVolumeClaim": {"claimName": "tandem-models",
                                                        "readOnly": True}},
     "Qwen2-VL-2B-Instruct"),
    ("ci/node-model-values.yaml", {"hostPath": {
        "path": "/var/lib/tandem/models/Qwen2-VL-2B-Instruct", "type": "Directory"}}, None)],
    ids=["claim", "node"])
def test_the_model_values_mount_the_model_into_the_scheduler_and_the_workers(
        helm: dict, values: str, volume: dict, sub_path: str | None) -> None:
    """The chart's model values, through the CRD's defaults and the operator's builders: the
    same directory, read-only at `path`, in both pods; TANDEM_MODEL names it."""
    path = yaml.safe_load((CHART / values).read_text())["service"]["model"]["path"]
    spec, _, _ = operator_view(render("helm4", (values,)))
    assert spec.model.setting == path
    cell = Cell(index=0, node="node-a", cache_bytes=1 << 30, requested_bytes=1 << 30,
                generation=1)
    for component in ("scheduler", "worker"):
        pod = build_pod_template(spec, cell, component)["spec"]
        assert {"name": "model", **volume} in pod["volumes"]
        [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model"]
        assert mount == {"name": "model", "mountPath": path, "readOnly": True,
                         **({"subPath": sub_path} if sub_path else {})}


@pytest.mark.parametrize("sets,refusal", [
    (('service.model.claimName="models"',), "need service.model.path"),
    (('service.model.hostPath="/data/q"',), "need service.model.path"),
    (('service.model.path="/models/q"', 'service.model.claimName="models"',
      'service.model.hostPath="/data/q"'), "exclude each other"),
    (('service.model.path="/models/q"', 'service.model.subPath="q"'),
     "needs service.model.claimName"),
    (('service.model.path="/models/q"', 'service.model.claimName="models"',
      'service.model.subPath="q/../.."'), "must not contain a '..' element"),
    (('service.model.path="/models/q"', 'service.model.hostPath="/data/../q"'),
     "must not contain a '..' element")],
    ids=["claim-without-path", "node-without-path", "claim-and-node", "subpath-without-claim",
         "subpath-backstep", "hostpath-backstep"])
def test_model_values_the_crd_would_refuse_fail_the_render(
        helm: dict, sets: tuple[str, ...], refusal: str) -> None:
    for major in MAJORS:
        with pytest.raises(RenderError, match=re.escape(refusal)):
            render_text(major, (), sets)


def test_podmonitor_follows_watched_namespaces(helm: dict) -> None:
    monitor = one(render("helm4", ("ci/watch-namespaces-values.yaml",), (MONITORING,)),
                  "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    everywhere = one(render("helm4", (), (MONITORING,)), "PodMonitor")
    assert everywhere["spec"]["namespaceSelector"] == {"any": True}


def test_pod_security_hook_labels_only_the_release_namespace(helm: dict) -> None:
    objects = render("helm4", ("ci/cpu-values.yaml",))
    role = one(objects, "ClusterRole", "podsecurity")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["namespaces"],
                              "resourceNames": [NAMESPACE], "verbs": ["get", "patch"]}]
    job = one(objects, "Job", "podsecurity")
    assert "pre-install" in job["metadata"]["annotations"]["helm.sh/hook"]
    assert not find(render("helm4"), "Job", "podsecurity")


def test_notes_guide_the_user(helm: dict) -> None:
    def notes(*sets: str) -> str:
        proc = run_helm("helm4", "install", RELEASE, str(CHART), "--dry-run=client",
                        "--namespace", NAMESPACE, *[f for s in sets for f in ("--set", s)])
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split("NOTES:", 1)[1]

    default = notes()
    assert f"kubectl -n {NAMESPACE} port-forward svc/{RELEASE} 50051:50051" in default
    assert "tandem generate --target localhost:50051" in default
    assert "pod-security.kubernetes.io/enforce=privileged" in default
    assert "Traces: off" in default
    traced = notes("tracing.jaeger.enabled=true", "podSecurity.labelNamespace=true")
    assert "WARNING" not in traced
    assert f"port-forward svc/{RELEASE}-jaeger 16686:16686" in traced


def test_tls_reaches_the_operator_and_the_helm_test_speaks_it(helm: dict,
                                                               tmp_path: Path) -> None:
    """With service.tls the operator mounts the Secrets into the scheduler; the helm test
    mounts the server Secret, and its health script, run for real against a mutual-TLS health
    server, connects with the flags it is given (`generate` gets the same)."""
    objects = render("helm4", ("ci/cells-values.yaml",))
    spec, scheduler, _ = operator_view(objects)
    assert (spec.tls.secret_name, spec.tls.client_ca_secret_name) == ("demo-tls", "tenants-ca")
    assert {v["name"] for v in scheduler["spec"]["volumes"]} >= {"tls", "client-ca"}
    pod = one(objects, "Pod", "test")["spec"]
    assert {"name": "tls", "secret": {"secretName": "demo-tls", "defaultMode": 0o444}} in pod[
        "volumes"]
    (health,), (generate, openai) = pod["initContainers"], pod["containers"]
    flags = ["--tls-ca", "/etc/tandem/tls/ca.crt", "--tls-cert", "/etc/tandem/tls/tls.crt",
             "--tls-key", "/etc/tandem/tls/tls.key"]
    assert health["command"][-6:] == flags and generate["args"][-7:-1] == flags
    assert openai["command"][3].startswith("https://") and openai["command"][-6:] == flags
    assert callable(build_parser().parse_args(generate["args"]).func)
    with pytest.raises(RenderError, match="clientCASecretName needs"):
        render("helm4", (), ('service.tls.clientCASecretName="ca"',))

    pki = make_pki(tmp_path)
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = HealthServicer()
    servicer.set("tandem.v1.Generation", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(pki.server_key.read_bytes(), pki.server_cert.read_bytes())],
        root_certificates=pki.ca.read_bytes(), require_client_auth=True))
    server.start()
    try:
        local = [str(pki.ca), str(pki.client_cert), str(pki.client_key)]
        args = [a for pair in zip(flags[::2], local, strict=True) for a in pair]
        out = subprocess.run([sys.executable, "-c", health["command"][2],
                              f"localhost:{port}", *args],
                             capture_output=True, text=True, timeout=60)
    finally:
        server.stop(grace=None)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1].endswith("tandem.v1.Generation SERVING"), out.stdout


def test_autosize_passes_through_to_the_operator(helm: dict) -> None:
    objects = render("helm4", (), ('service.featureCache.autoSize={"min":"1Gi","max":"16Gi"}',))
    assert one(objects, "TandemService")["spec"]["featureCache"]["autoSize"] == {
        "min": "1Gi", "max": "16Gi"}
    spec, _, _ = operator_view(objects)
    assert spec.cache.auto_size is not None and spec.cache.auto_size.max == 16 << 30
    with pytest.raises(RenderError, match="autoSize"):  # the schema wants both bounds
        render("helm4", (), ('service.featureCache.autoSize={"min":"1Gi"}',))


@pytest.mark.parametrize("sets,grace", [((), DEFAULT_GRACE_S),
                                        (("service.shutdownGraceSeconds=90",), 90.0),
                                        (("service.shutdownGraceSeconds=0",), 0.0)],
                         ids=["default", "90", "0"])
def test_the_shutdown_grace_reaches_the_pods(helm: dict, sets: tuple[str, ...],
                                             grace: float) -> None:
    """Issue 22, item 6: service.shutdownGraceSeconds, through the CRD and the operator's
    builders, is the scheduler's TANDEM_SHUTDOWN_GRACE and sets its pod's grace (0 too)."""
    spec, scheduler, _ = operator_view(render("helm4", (), sets))
    assert spec.shutdown_grace == grace
    assert env_of(scheduler["spec"]["containers"][0])["TANDEM_SHUTDOWN_GRACE"] == f"{grace:g}"
    assert scheduler["spec"]["terminationGracePeriodSeconds"] == int(grace + STOP_MARGIN_S)


@pytest.mark.parametrize(("sets", "names"), [((), []),
                                             (('service.model.servedNames=["my-model","alias"]',),
                                              ["my-model", "alias"])],
                         ids=["default", "two"])
def test_the_served_model_names_reach_the_schedulers(helm: dict, monkeypatch: pytest.MonkeyPatch,
                                                     sets: tuple[str, ...],
                                                     names: list[str]) -> None:
    """Issue 22, item 13: service.model.servedNames, through the CRD and the operator's
    builders, is what the scheduler's --served-model-name reads from its cell's settings;
    none set leaves the setting out (the cell's settings, and so its hash, as before)."""
    spec, _, _ = operator_view(render("helm4", (), sets))
    assert list(spec.model.served_names) == names
    config = cell_config(spec, Cell(index=0, node="node-a", cache_bytes=1 << 30,
                                    requested_bytes=1 << 30, generation=1))
    if not names:
        assert "TANDEM_SERVED_MODEL_NAME" not in config
        return
    monkeypatch.setenv("TANDEM_SERVED_MODEL_NAME", config["TANDEM_SERVED_MODEL_NAME"])
    assert build_parser().parse_args(["scheduler"]).served_model_name == names
