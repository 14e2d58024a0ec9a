"""The CRD's CEL rules (x-kubernetes-validations), evaluated with a real CEL implementation
(cel-python, through the emulator's kube_emulator.cel) as a current apiserver evaluates them:
on every default as written and with nested defaults filled in, on every example in docs/ and
every TandemService the chart renders; and the operator's parser refuses every object a rule
refuses, for clusters where the apiserver drops the rules (CEL off).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_emulator.cel import default_failures, rule_failures
from kube_emulator.fixtures import CRD_PATH, REPO, SCHEMA
from kube_emulator.patches import merge_patch
from kube_emulator.schema import apply_defaults, cel_rules, defaults, load_crd, validation_errors
from test_chart_harness import (
    ALL_ON,
    ALL_ON_SETS,
    CI_VALUES,
    helm_fixture,  # noqa: F401
    render,
)

from tandem_operator.spec import KIND, MAX_NAME_LENGTH, SpecError, parse_spec

# One object per rule that breaks that rule only: (metadata.name, merge patch over spec {}).
VIOLATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "size(self.metadata.name) <= 39": ("a" * (MAX_NAME_LENGTH + 1), {}),
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')": ("7th.demo", {}),
    "!has(self.claimName) || has(self.path)": ("demo", {"model": {"claimName": "models"}}),
    "!has(self.hostPath) || has(self.path)": ("demo", {"model": {"hostPath": "/data/q"}}),
    "!has(self.claimName) || !has(self.hostPath)": (
        "demo", {"model": {"path": "/models/q", "claimName": "models", "hostPath": "/data/q"}}),
    "!has(self.subPath) || has(self.claimName)": (
        "demo", {"model": {"path": "/models/q", "subPath": "q"}}),
    "!self.matches('^/+(tmp|dev/shm|var/run/tandem|etc/tandem/tls|etc/tandem/client-ca)?/*$')": (
        "demo", {"model": {"path": "/tmp/"}}),
    "!self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')": (
        "demo", {"model": {"path": "/models/q", "claimName": "models", "subPath": "q/../.."}}),
    "!self.contains('/../') && !self.endsWith('/..')": (
        "demo", {"model": {"path": "/models/q", "hostPath": "/data/q/.."}}),
    "!has(self.port) || !(self.port in [9400, 9401, 50061])": (
        "demo", {"scheduler": {"port": 50061}}),
    "!has(self.http) || !has(self.http.port) || !(self.http.port in [9400, 9401, 50061, "
    "has(self.scheduler) && has(self.scheduler.port) ? self.scheduler.port : 50051])": (
        "demo", {"http": {"port": 50051}}),
    "!has(self.device) || !self.device.startsWith('cuda') || !has(self.gpu) "
    "|| !has(self.gpu.count) || self.gpu.count > 0": (
        "demo", {"worker": {"device": "cuda:1", "gpu": {"count": 0}}}),
    "!has(self.workersPerCell) || !has(self.tensorParallelSize) "
    "|| self.workersPerCell % self.tensorParallelSize == 0": (
        "demo", {"worker": {"workersPerCell": 3, "tensorParallelSize": 2}}),
    "!has(self.clientCASecretName) || has(self.secretName)": (
        "demo", {"tls": {"clientCASecretName": "tenants-ca"}}),
    "!has(self.autoSize) || !has(self.type) || self.type != 'none'": (
        "demo", {"featureCache": {"type": "none", "autoSize": {"min": "1Gi", "max": "4Gi"}}}),
}


def tandem_service(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A TandemService after the apiserver's defaulting."""
    obj = {"apiVersion": "tandem.dev/v1alpha1", "kind": KIND,
           "metadata": {"name": name, "namespace": "serving"}, "spec": merge_patch({}, spec)}
    apply_defaults(SCHEMA, obj)
    return obj


def test_every_rule_of_the_crd_has_a_violating_object() -> None:
    assert sorted(rule for _, rule in cel_rules(SCHEMA)) == sorted(VIOLATIONS)


@pytest.mark.parametrize("rule", VIOLATIONS, ids=range(len(VIOLATIONS)))
def test_cel_and_the_parser_refuse_the_same_object(rule: str) -> None:
    name, patch = VIOLATIONS[rule]
    obj = tandem_service(name, patch)
    assert list(validation_errors(SCHEMA, obj)) == []  # only the rule stands in the way
    assert [f.rule for f in rule_failures(SCHEMA, obj)] == [rule]
    with pytest.raises(SpecError):
        parse_spec(name, "serving", obj["spec"])


def test_the_longest_name_passes_both() -> None:
    name = "a" * MAX_NAME_LENGTH
    obj = tandem_service(name, {})
    assert list(rule_failures(SCHEMA, obj)) == []
    parse_spec(name, "serving", obj["spec"])


def test_every_default_holds_raw_and_defaulted() -> None:
    """Raw: what the apiserver checks when the CRD is created (an unguarded rule fails there
    with `no such key`). Defaulted: what every object sees after defaulting."""
    assert list(default_failures(load_crd(CRD_PATH))) == []
    nodes = list(defaults(SCHEMA, "openAPIV3Schema"))
    assert len(nodes) > 20
    for path, node in nodes:
        value = copy.deepcopy(node["default"])
        apply_defaults(node, value)
        assert list(rule_failures(node, value, root=False)) == [], path


def test_an_unguarded_rule_is_refused_on_its_default() -> None:
    """The failure the issue met on a real apiserver: the rule as it was, on `default: {}`."""
    crd = load_crd(CRD_PATH)
    worker = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["worker"]
    worker["x-kubernetes-validations"][0]["rule"] = (
        "!self.device.startsWith('cuda') || self.gpu.count > 0")
    assert list(default_failures(crd)) == [
        "spec.versions[0].schema.openAPIV3Schema.properties[spec].properties[worker].default: "
        "Invalid value: {}: no such key: device evaluating rule: device cuda needs gpu.count >= 1"]


def examples() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{p.relative_to(REPO)}:{d['metadata']['name']}", d)
            for p in sorted((REPO / "docs").rglob("*.yaml"))
            for d in yaml.safe_load_all(p.read_text()) if d and d.get("kind") == KIND]


@pytest.mark.parametrize("where,doc", examples(), ids=[w for w, _ in examples()])
def test_every_docs_example_passes_the_rules(where: str, doc: dict[str, Any]) -> None:
    apply_defaults(SCHEMA, doc)
    assert [str(f) for f in rule_failures(SCHEMA, doc)] == [], where


@pytest.mark.parametrize("values,sets", [((v,), ()) for v in CI_VALUES] + [(ALL_ON, ALL_ON_SETS)],
                         ids=[*(Path(v).stem for v in CI_VALUES), "all-on"])
def test_every_rendered_tandemservice_passes_the_rules(
        helm: dict[str, Path], values: tuple[str, ...], sets: tuple[str, ...]) -> None:
    found = [o for o in render("helm3", values, sets) if o["kind"] == KIND]
    assert len(found) == 1 or values == ("ci/watch-namespaces-values.yaml",)  # serves others
    for obj in found:
        apply_defaults(SCHEMA, obj)
        assert [str(f) for f in rule_failures(SCHEMA, obj)] == []


@pytest.mark.parametrize("rule", VIOLATIONS, ids=range(len(VIOLATIONS)))
def test_deletion_still_parses_a_spec_that_breaks_a_rule(rule: str) -> None:
    """An older operator may have placed cells of such a spec; their cleanup needs it parsed."""
    name, patch = VIOLATIONS[rule]
    spec = parse_spec(name, "serving", tandem_service(name, patch)["spec"], check_rules=False)
    assert spec.name == name
