"""The CRD is the single source of the TandemService schema and its defaults: the operator's
parser, the status it writes and every example in docs/ must agree with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kube_emulator.cel import rule_failures
from kube_emulator.fixtures import CRD_PATH, REPO, SCHEMA, defaulted_spec, tandem_spec
from kube_emulator.schema import apply_defaults, cel_rules, load_crd, validation_errors

import tandem
from tandem_operator.conditions import PodInfo, invalid_spec_conditions
from tandem_operator.manifests import HEALTH_PORT, SCHEDULER_METRICS_PORT, WORKER_METRICS_PORT
from tandem_operator.placement import Cell
from tandem_operator.reconcile import ServiceState, status_payload
from tandem_operator.spec import (
    GROUP,
    KIND,
    PLURAL,
    RESERVED_MOUNTS,
    RESERVED_PORTS,
    VERSION,
    SpecError,
    parse_spec,
)
from tandem_operator.workloads import build_pod_template

EXAMPLES = sorted((REPO / "docs").rglob("*.yaml"))


@pytest.mark.parametrize("version", ["1.30.0", kubernetes_validate.latest_version()])
def test_crd_passes_strict_schema_validation(version: str) -> None:
    kubernetes_validate.validate(load_crd(CRD_PATH), version, strict=True)


def test_crd_names_and_subresources() -> None:
    crd = load_crd(CRD_PATH)
    spec = crd["spec"]
    assert (spec["group"], spec["names"]["kind"], spec["names"]["plural"]) == (GROUP, KIND, PLURAL)
    assert spec["scope"] == "Namespaced" and spec["names"]["shortNames"] == ["tsvc"]
    [version] = spec["versions"]
    assert version["name"] == VERSION and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.cells"
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Reason", "Cells", "Cache", "Age", "Endpoint"]


def test_default_image_is_this_version() -> None:
    image = defaulted_spec()["image"]
    assert image["repository"] == "ghcr.io/tandem-dev/tandem"
    assert image["tag"] == tandem.__version__


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == KIND]


def test_there_are_examples() -> None:
    assert sum(len(documents(p)) for p in EXAMPLES) >= 3


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_example_validates_and_parses(path: Path) -> None:
    for doc in documents(path):
        assert list(validation_errors(SCHEMA, doc)) == [], path
        apply_defaults(SCHEMA, doc)
        assert list(validation_errors(SCHEMA, doc)) == [], path
        parse_spec(doc["metadata"]["name"], doc["metadata"]["namespace"], doc["spec"])


@pytest.mark.parametrize("version", ["1.30.0", kubernetes_validate.latest_version()])
def test_the_other_objects_of_the_examples_validate(version: str) -> None:
    """What the docs ask users to apply besides TandemServices (the model's claim and the
    pod that copies a model onto it)."""
    others = [d for p in EXAMPLES for d in yaml.safe_load_all(p.read_text())
              if d and d.get("kind") != KIND]
    assert {d["kind"] for d in others} >= {"PersistentVolumeClaim", "Pod"}
    for doc in others:
        kubernetes_validate.validate(doc, version, strict=True)


def test_unknown_fields_and_bad_values_are_caught() -> None:
    doc = {"apiVersion": "tandem.dev/v1alpha1", "kind": KIND, "metadata": {"name": "x"},
           "spec": {"featureCache": {"sise": "1Gi", "size": "lots"}, "cells": -1}}
    errors = "\n".join(validation_errors(SCHEMA, doc))
    assert "sise" in errors and "spec.featureCache.size" in errors and "spec.cells" in errors


class Recording(dict):  # type: ignore[type-arg]
    """A dict that records the path of every key read from it (and from nested dicts)."""

    def __init__(self, data: dict[str, Any], path: str, seen: set[str]) -> None:
        super().__init__(data)
        self.path, self.seen = path, seen

    def _wrap(self, key: str, value: Any) -> Any:
        self.seen.add(f"{self.path}.{key}")
        return Recording(value, f"{self.path}.{key}", self.seen) if isinstance(
            value, dict) else value

    def __getitem__(self, key: str) -> Any:
        return self._wrap(key, super().__getitem__(key))

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(f"{self.path}.{key}")
        return self._wrap(key, super().__getitem__(key)) if key in self else default


def declared(path: str) -> bool:
    node: dict[str, Any] = SCHEMA
    for key in path.split("."):
        props = node.get("properties") or {}
        if key in props:
            node = props[key]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return False
    return True


def test_the_parser_reads_only_declared_fields_and_needs_only_defaults() -> None:
    seen: set[str] = set()
    spec = defaulted_spec({"model": {"path": "/m", "claimName": "c"},
                           "placement": {"nodeSelector": {"a": "b"}}})
    parse_spec("demo", "ns", Recording(spec, "spec", seen))
    undeclared = sorted(p for p in seen if not declared(p))
    assert undeclared == []
    assert {"spec.featureCache.size", "spec.worker.gpu.resourceName"} <= seen


def test_a_spec_without_the_crd_defaults_is_refused_clearly() -> None:
    with pytest.raises(SpecError, match="install the CRD from charts/tandem/crds"):
        parse_spec("demo", "ns", {"cells": 1})


def test_the_ports_scheduler_port_must_avoid_are_the_pods_own() -> None:
    """The CEL rule and the parser (both in test_crd_cel.py) name these three ports."""
    assert set(RESERVED_PORTS) == {SCHEDULER_METRICS_PORT, WORKER_METRICS_PORT, HEALTH_PORT}
    [rule] = [r for path, r in cel_rules(SCHEMA) if path == "spec.scheduler"]
    assert all(str(port) in rule for port in RESERVED_PORTS)


def test_the_mounts_model_path_must_avoid_are_the_pods_own() -> None:
    """The CEL rule on model.path and the parser name every directory the cell pods mount
    (with everything on), so a model volume never collides with one of them."""
    spec = tandem_spec({"model": {"path": "/models/q", "claimName": "models"},
                        "tls": {"secretName": "t", "clientCASecretName": "ca"}})
    cell = Cell(0, "a", 1 << 30, 1 << 30, 1)
    own = {m["mountPath"] for component in ("scheduler", "worker")
           for m in build_pod_template(spec, cell, component)["spec"]["containers"][0][
               "volumeMounts"] if m["name"] != "model"}
    assert own == set(RESERVED_MOUNTS)
    [rule] = [r for path, r in cel_rules(SCHEMA) if path == "spec.model.path"]
    assert all(mount.lstrip("/") in rule for mount in RESERVED_MOUNTS)
    for path in ("/", "//", "/tmp", "/tmp/", "/dev/shm", "//var/run/tandem//"):
        with pytest.raises(SpecError, match="is taken"):
            tandem_spec({"model": {"path": path}})
    for path in ("/tmpx", "/tmp/models/q", "/models", "/dev/shm2"):
        assert tandem_spec({"model": {"path": path}}).model.setting == path


@pytest.mark.parametrize("sub_path,ok", [
    ("q", True), ("org/q-2b", True), ("..q", True), ("q../r", True), ("./q", True),
    ("/q", False), ("..", False), ("../q", False), ("q/..", False), ("q/../../r", False)])
def test_a_sub_path_is_a_relative_path_without_backsteps(sub_path: str, ok: bool) -> None:
    """The parser and the CEL rule agree on both sides of the line (Kubernetes' own check
    on a volume mount's subPath)."""
    model = {"path": "/models/q", "claimName": "models", "subPath": sub_path}
    failures = [f.rule for f in rule_failures(
        SCHEMA, {"metadata": {"name": "demo"}, "spec": defaulted_spec({"model": model})})]
    assert (failures == []) == ok, failures
    if ok:
        assert tandem_spec({"model": model}).model.sub_path == sub_path
    else:
        with pytest.raises(SpecError, match=r"relative path without '\.\.'"):
            tandem_spec({"model": model})


@pytest.mark.parametrize("host_path,ok", [
    ("/data/models/q", True), ("/data/..q/q..", True), ("/data/../q", False),
    ("/data/q/..", False), ("/..", False)])
def test_a_host_path_has_no_backsteps(host_path: str, ok: bool) -> None:
    model = {"path": "/models/q", "hostPath": host_path}
    failures = [f.rule for f in rule_failures(
        SCHEMA, {"metadata": {"name": "demo"}, "spec": defaulted_spec({"model": model})})]
    assert (failures == []) == ok, failures
    if ok:
        assert tandem_spec({"model": model}).model.host_path == host_path
    else:
        with pytest.raises(SpecError, match=r"must not contain a '\.\.' element"):
            tandem_spec({"model": model})


def test_model_fields_refused_by_the_structural_schema() -> None:
    """What no CEL rule has to say because the schema already refuses it (always on)."""
    for model, field in (({"path": "models/q"}, "path"), ({"path": "/m", "claimName": ""},
                                                           "claimName"),
                         ({"path": "/m", "claimName": "Models"}, "claimName"),
                         ({"path": "/m", "claimName": "m", "subPath": ""}, "subPath"),
                         ({"path": "/m", "hostPath": "data/q"}, "hostPath")):
        doc = {"apiVersion": "tandem.dev/v1alpha1", "kind": KIND,
               "metadata": {"name": "demo"}, "spec": {"model": model}}
        errors = list(validation_errors(SCHEMA, doc))
        assert errors and all(e.startswith(f"spec.model.{field}:") for e in errors), errors


def test_tensor_parallelism_and_the_routing_parse() -> None:
    spec = tandem_spec({"cells": 3, "worker": {"workersPerCell": 4, "tensorParallelSize": 2},
                        "routing": {"loadFactor": 1.5, "envoy": {"replicas": 2}}})
    assert spec.worker.tensor_parallel_size == 2 and spec.picked
    assert (spec.routing.envoy.replicas, spec.routing.load_factor) == (2, 1.5)
    assert spec.routing.envoy.resources.requests == {"cpu": "250m", "memory": "256Mi"}
    assert not tandem_spec({"cells": 1}).picked, "one cell needs no picker"
    with pytest.raises(SpecError, match=r"multiple of worker\.tensorParallelSize"):
        tandem_spec({"worker": {"workersPerCell": 3, "tensorParallelSize": 2}})


def test_status_the_operator_writes_is_declared_and_never_pruned() -> None:
    spec = tandem_spec({"cells": 2})
    state = ServiceState([Cell(0, "a", 1 << 30, 4 << 30, 3), Cell(1, "", 0, 4 << 30, 0, "no")],
                         rejected={0: "violates PodSecurity"})
    pods = [PodInfo("p", "scheduler", 0, "a", True, "x", False)]
    status = status_payload(spec, state, pods, {}, "2026-01-01T00:00:00Z", 4)
    status["observedGeneration"] = 4
    status_schema = SCHEMA["properties"]["status"]
    assert list(validation_errors(status_schema, status)) == []
    invalid = {"conditions": invalid_spec_conditions("bad", [], "2026-01-01T00:00:00Z", 1)}
    assert list(validation_errors(status_schema, invalid)) == []
