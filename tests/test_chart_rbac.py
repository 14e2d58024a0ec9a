"""The operator's RBAC is exactly what operator/ uses: derived here from the source, compared
with the rendered ClusterRole/Roles in both namespace modes.

Two sources of API calls:
- kopf, on the operator's behalf, read from kopf's handler registry after importing the package:
  indexes list and watch; change handlers and timers list, watch and patch their resource (and
  its status subresource when handlers write `patch.status`); handlers post Events; kopf watches
  CRDs, and namespaces when it serves a list of them (kopf/_core/reactor/observation.py).
- `KubeApi` (operator/tandem_operator/kube.py), whose call sites are resolved with `ast`: the
  kind of each call is a string literal, a dict literal's "kind", or a `build_*` builder's
  kind, followed through local assignments and for-loops. A call whose kind cannot be
  resolved fails the test.
And what the operator grants: the endpoint picker's Role (EPP_RULES), which Kubernetes lets it
create only if it holds those permissions itself.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from pathlib import Path

import kopf
import pytest
import yaml
from test_chart_harness import (
    CRD_FILE,
    find,
    helm_fixture,  # noqa: F401 (registers the session fixture `helm`)
    one,
    render,
)

import tandem_operator
from tandem_operator.gateway import EPP_RULES
from tandem_operator.kube import _KINDS, KubeApi

Rule = tuple[str, str, str]  # (apiGroup, resource, verb)
OPERATOR_DIR = Path(tandem_operator.__file__).parent
SOURCES = {p.name: ast.parse(p.read_text()) for p in sorted(OPERATOR_DIR.glob("*.py"))}
# kind -> (apiGroup, plural, namespaced) of the kinds KubeApi handles.
KIND_RESOURCES = {
    "Pod": ("", "pods", True),
    "Secret": ("", "secrets", True),
    "ConfigMap": ("", "configmaps", True),
    "Service": ("", "services", True),
    "StatefulSet": ("apps", "statefulsets", True),
    "Deployment": ("apps", "deployments", True),
    "Job": ("batch", "jobs", True),
    "InferencePool": ("inference.networking.k8s.io", "inferencepools", True),
    "ServiceAccount": ("", "serviceaccounts", True),
    "Role": ("rbac.authorization.k8s.io", "roles", True),
    "RoleBinding": ("rbac.authorization.k8s.io", "rolebindings", True),
}
# KubeApi method -> verbs it sends; `apply(create_only=True)` sends create only.
KUBEAPI_VERBS = {"apply": ("create", "patch"), "dry_run_create": ("create",),
                 "delete": ("delete",), "read": ("get",), "list": ("list",)}
CLUSTER_SCOPED = {("", "nodes"), ("", "namespaces"),
                  ("apiextensions.k8s.io", "customresourcedefinitions")}


def test_kubeapi_surface_is_known() -> None:
    public = {n for n, f in inspect.getmembers(KubeApi, inspect.iscoroutinefunction)
              if not n.startswith("_")}
    assert public == set(KUBEAPI_VERBS), "a new KubeApi method needs a row in KUBEAPI_VERBS"
    assert set(_KINDS) <= set(KIND_RESOURCES)


def builder_kinds() -> dict[str, str]:
    """`build_*` function -> the kind of the object it returns (its dict literal's "kind")."""
    fns = [fn for tree in SOURCES.values() for fn in ast.walk(tree)
           if isinstance(fn, ast.FunctionDef) and fn.name.startswith("build_")]
    kinds: dict[str, str] = {}
    while True:  # a builder that returns another builder's object has its kind
        before = len(kinds)
        for fn in fns:
            found = {k for node in ast.walk(fn) for k in _dict_kind(node)} or {
                kinds[node.func.id] for node in ast.walk(fn)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in kinds}
            if len(found) == 1:
                kinds[fn.name] = found.pop()
        if len(kinds) == before:
            return kinds


def _dict_kind(node: ast.AST) -> set[str]:
    """The kind of an object's dict literal (one with an apiVersion: not a reference such as
    an InferencePool's endpointPickerRef)."""
    if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "apiVersion"
                                          for k in node.keys):
        for key, value in zip(node.keys, node.values, strict=True):
            if (isinstance(key, ast.Constant) and key.value == "kind"
                    and isinstance(value, ast.Constant)):
                return {value.value}
    return set()


class KindResolver:
    """Kinds an expression may evaluate to inside one function."""

    def __init__(self, fn: ast.AST, builders: dict[str, str]) -> None:
        self.builders = builders
        self.bindings: dict[str, list[ast.expr]] = {}
        for node in ast.walk(fn):  # assignments first: a loop may precede them in the walk
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    self._bind(target, node.value)
        for node in ast.walk(fn):
            if isinstance(node, ast.For):
                for element in self._elements(node.iter):
                    self._bind(node.target, element)

    def _elements(self, iterable: ast.expr) -> list[ast.expr]:
        if isinstance(iterable, ast.List | ast.Tuple):
            return list(iterable.elts)
        if isinstance(iterable, ast.Name):
            return [e for v in self.bindings.get(iterable.id, []) for e in self._elements(v)]
        return [iterable]  # e.g. `for sts in await kube.list(...)`: not an object we build

    def _bind(self, target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, ast.Name):
            self.bindings.setdefault(target.id, []).append(value)
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            for t, v in zip(target.elts, value.elts, strict=True):
                self._bind(t, v)

    def kinds(self, expr: ast.expr) -> set[str]:
        if isinstance(expr, ast.Constant) and expr.value in KIND_RESOURCES:
            return {expr.value}
        if isinstance(expr, ast.Dict):
            return _dict_kind(expr)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name):
            return {self.builders[expr.func.id]} if expr.func.id in self.builders else set()
        if isinstance(expr, ast.List | ast.Tuple):
            return {k for e in expr.elts for k in self.kinds(e)}
        if isinstance(expr, ast.Name):
            return {k for v in self.bindings.get(expr.id, []) for k in self.kinds(v)}
        return set()


def _is_kube(receiver: ast.expr) -> bool:
    """`kube` (the handlers pass it down by that name) or `memo["kube"]` (where kopf keeps it)."""
    if isinstance(receiver, ast.Name):
        return receiver.id == "kube"
    return (isinstance(receiver, ast.Subscript) and isinstance(receiver.slice, ast.Constant)
            and receiver.slice.value == "kube")


def kubeapi_calls() -> Iterator[tuple[str, int, str, set[str], bool]]:
    """(file, line, method, kinds, create_only) of every KubeApi call."""
    builders = builder_kinds()
    for name, tree in SOURCES.items():
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            resolver = KindResolver(fn, builders)
            for call in ast.walk(fn):
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                        and _is_kube(call.func.value) and call.func.attr in KUBEAPI_VERBS):
                    create_only = any(k.arg == "create_only" and isinstance(k.value, ast.Constant)
                                      and k.value.value is True for k in call.keywords)
                    yield (name, call.lineno, call.func.attr, resolver.kinds(call.args[0]),
                           create_only)


def client_rules() -> set[Rule]:
    rules = set()
    for name, line, method, kinds, create_only in kubeapi_calls():
        assert kinds, f"operator/{name}:{line}: cannot tell which kind kube.{method}() touches"
        verbs = ("create",) if create_only else KUBEAPI_VERBS[method]
        for kind in kinds:
            group, plural, _ = KIND_RESOURCES[kind]
            rules |= {(group, plural, verb) for verb in verbs}
    return rules


def _source_uses(attribute_chain: str) -> bool:
    """Whether any operator source reads e.g. `kopf.adopt` or `patch.status`."""
    first, second = attribute_chain.split(".")
    return any(isinstance(n, ast.Attribute) and n.attr == second
               and isinstance(n.value, ast.Name) and n.value.id == first
               for tree in SOURCES.values() for n in ast.walk(tree))


def kopf_rules(namespaced_mode: bool) -> set[Rule]:
    registry = kopf.get_default_registry()
    rules: set[Rule] = {("apiextensions.k8s.io", "customresourcedefinitions", v)
                        for v in ("list", "watch")}
    if namespaced_mode:
        rules |= {("", "namespaces", "list"), ("", "namespaces", "watch")}
    crd = yaml.safe_load(CRD_FILE.read_text())
    for handler in registry._indexing.get_all_handlers():
        s = handler.selector
        rules |= {(s.group, s.any_name, "list"), (s.group, s.any_name, "watch")}
    served = [*registry._changing.get_all_handlers(), *registry._spawning.get_all_handlers()]
    for handler in served:
        s = handler.selector
        rules |= {(s.group, s.any_name, v) for v in ("list", "watch", "patch")}
        assert (s.group, s.any_name) == (crd["spec"]["group"], crd["spec"]["names"]["plural"])
        has_status = all("status" in (v.get("subresources") or {})
                         for v in crd["spec"]["versions"])
        if has_status and _source_uses("patch.status"):
            rules.add((s.group, f"{s.any_name}/status", "patch"))
        if _source_uses("kopf.adopt"):  # blockOwnerDeletion: true on the children
            rules.add((s.group, f"{s.any_name}/finalizers", "update"))
    if served:  # kopf posts handler outcomes; the handlers call kopf.info/warn
        rules.add(("", "events", "create"))
    return rules


def expected(namespaced_mode: bool) -> tuple[set[Rule], set[Rule]]:
    """(cluster-scoped rules, namespaced rules) the operator needs."""
    everything = kopf_rules(namespaced_mode) | client_rules() | flatten({"rules": EPP_RULES})
    cluster = {r for r in everything if (r[0], r[1]) in CLUSTER_SCOPED}
    return cluster, everything - cluster


def flatten(role: dict) -> set[Rule]:
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def test_operator_source_analysis_finds_the_calls() -> None:
    """Guards the analysis itself: known calls of operator/tandem_operator/reconcile.py are seen."""
    calls = {(m, frozenset(k), c) for _, _, m, k, c in kubeapi_calls()}
    assert ("delete", frozenset({"Pod"}), False) in calls
    assert ("dry_run_create", frozenset({"Pod"}), False) in calls
    assert ("apply", frozenset({"Job"}), True) in calls
    assert ("apply", frozenset({"ConfigMap", "StatefulSet"}), False) in calls


def test_clusterwide_rbac_is_exactly_what_the_operator_uses(helm: dict) -> None:
    objects = render("helm4")
    cluster, namespaced = expected(namespaced_mode=False)
    role = one(objects, "ClusterRole", "operator")
    assert flatten(role) == cluster | namespaced, (
        f"missing: {(cluster | namespaced) - flatten(role)}, unused: "
        f"{flatten(role) - (cluster | namespaced)}")
    assert not find(objects, "Role", "operator")
    binding = one(objects, "ClusterRoleBinding", "operator")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


@pytest.mark.parametrize("major", ["helm3", "helm4"])
def test_namespaced_rbac_is_exactly_what_the_operator_uses(helm: dict, major: str) -> None:
    objects = render(major, ("ci/watch-namespaces-values.yaml",))
    cluster, namespaced = expected(namespaced_mode=True)
    assert flatten(one(objects, "ClusterRole", "operator")) == cluster
    roles = find(objects, "Role", "operator")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert flatten(role) == namespaced, role["metadata"]["namespace"]
    account = one(objects, "ServiceAccount", "operator")["metadata"]
    for binding in find(objects, "RoleBinding", "operator"):
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": roles[0]["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["name"],
                                        "namespace": account["namespace"]}]
