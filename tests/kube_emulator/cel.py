"""CRD validation rules (`x-kubernetes-validations`) evaluated the way a current kube-apiserver
evaluates them, with a real CEL implementation (cel-python).

Two checks, as the apiserver makes them:

- on every write of a custom resource, after defaulting: each rule of each schema node whose
  value is present, `self` being that value (the root sees `apiVersion`, `kind`, `spec`,
  `status` and only `metadata.name` and `metadata.generateName`), array items and map values
  by their own schemas. A rule that evaluates to false fails with its message; one that cannot
  be evaluated (a field read without `has()` that is absent) fails with the error.
- on CRD creation (`default_failures`): every `default` against the rules of its schema node
  and of the nodes below it, **as written**, before nested defaults are filled in.

`number` fields are doubles in CEL even when JSON writes them as integers; unknown functions
are refused at CRD creation. Only standard CEL is provided: none of the CRD's rules calls a
Kubernetes library function (quantity, lists, strings extensions), so none is implemented.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import celpy
import lark
from celpy import celtypes
from celpy.evaluation import base_functions

from kube_emulator.schema import defaults

Schema = dict[str, Any]
# Macros are expanded by the parser, not looked up as functions.
_MACROS = frozenset({"has", "all", "exists", "exists_one", "map", "filter"})
_KNOWN = _MACROS | frozenset(base_functions)
_MISSING = re.compile(r"no such member in mapping: \\*'([^'\\]*)")  # quotes may be escaped
_ENV = celpy.Environment()


@dataclass(frozen=True)
class RuleFailure:
    """One rule that refused a value, as the apiserver reports it in a 422 answer."""

    path: str  # the schema node's field path, e.g. "spec.worker" ("<root>" for the object)
    rule: str
    value_type: str  # the node's type, as the apiserver prints it ("object", "string")
    detail: str  # the rule's message, or why it could not be evaluated

    def __str__(self) -> str:
        return f'{self.path}: Invalid value: "{self.value_type}": {self.detail}'


@functools.cache
def _program(rule: str) -> celpy.Runner:
    """The compiled rule; raises celpy.CELParseError, or ValueError for unknown functions."""
    tree = _ENV.compile(rule)
    unknown = sorted(_functions(tree) - _KNOWN)
    if unknown:
        raise ValueError(f"undeclared reference to {', '.join(unknown)} (not modelled by "
                         "the emulator: add the Kubernetes library function to "
                         "kube_emulator/cel.py)")
    return _ENV.program(tree)


def _functions(tree: lark.Tree) -> set[str]:
    """Names of the functions and methods a compiled rule calls."""
    names = set()
    for node in tree.iter_subtrees():
        if node.data == "ident_arg":
            names.add(str(node.children[0]))
        elif node.data == "member_dot_arg":
            names.add(str(node.children[1]))
    return names


def _to_cel(schema: Schema, value: Any) -> Any:
    """A JSON value as CEL sees it under `schema` (numbers of `type: number` are doubles)."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        return celtypes.MapType({
            celtypes.StringType(k): _to_cel(props.get(k, extra if isinstance(extra, dict) else {}),
                                            v)
            for k, v in value.items()})
    if isinstance(value, list):
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        return celtypes.ListType([_to_cel(items, v) for v in value])
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return celtypes.DoubleType(value)
    return celpy.json_to_cel(value)


def _root_view(obj: dict[str, Any]) -> dict[str, Any]:
    """The resource root as its rules see it: of metadata only name and generateName."""
    meta = obj.get("metadata") or {}
    return {**obj, "metadata": {k: meta[k] for k in ("name", "generateName") if k in meta}}


def _reason(error: Exception) -> str:
    """The apiserver's wording for an evaluation error (cel-python nests the first cause)."""
    missing = _MISSING.search(repr(error))
    if missing:
        return f"no such key: {missing.group(1)}"
    return str(error.args[0]) if error.args else repr(error)


def _evaluate(rule: dict[str, str], schema: Schema, value: Any, path: str) -> RuleFailure | None:
    text = rule["rule"]
    shown = rule.get("message") or f"failed rule: {text}"
    value_type = str(schema.get("type", "object"))
    try:
        result = _program(text).evaluate({"self": _to_cel(schema, value)})
    except celpy.CELEvalError as e:
        return RuleFailure(path, text, value_type, f"{_reason(e)} evaluating rule: {shown}")
    if isinstance(result, celpy.CELEvalError):
        return RuleFailure(path, text, value_type, f"{_reason(result)} evaluating rule: {shown}")
    if not isinstance(result, celtypes.BoolType):
        return RuleFailure(path, text, value_type, f"rule did not evaluate to a bool: {text}")
    return None if result else RuleFailure(path, text, value_type, shown)


def rule_failures(schema: Schema, value: Any, path: str = "",
                  root: bool = True) -> Iterator[RuleFailure]:
    """Every rule of `schema` and the nodes below it that refuses `value` (a defaulted
    object when `root`, else the value of the node at `path`)."""
    if value is None:
        return
    here = path or "<root>"
    view = _root_view(value) if root and isinstance(value, dict) else value
    for rule in schema.get("x-kubernetes-validations") or ():
        failure = _evaluate(rule, schema, view, here)
        if failure is not None:
            yield failure
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                yield from rule_failures(sub, item, f"{path}.{key}" if path else key, False)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from rule_failures(schema["items"], item, f"{here}[{i}]", False)


def compile_failures(schema: Schema, path: str) -> Iterator[str]:
    """Rules that do not compile (syntax, or a function the emulator does not know)."""
    for i, rule in enumerate(schema.get("x-kubernetes-validations") or ()):
        try:
            _program(rule["rule"])
        except (celpy.CELParseError, ValueError) as e:
            yield f"{path}.x-kubernetes-validations[{i}].rule: Invalid value: {rule['rule']!r}: " \
                  f"compilation failed: {e}"
    for key, sub in (schema.get("properties") or {}).items():
        yield from compile_failures(sub, f"{path}.properties[{key}]")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from compile_failures(schema[key], f"{path}.{key}")


def default_failures(crd: dict[str, Any]) -> Iterator[str]:
    """What the apiserver refuses a CRD for: rules that do not compile, and defaults (raw, as
    written) that break a rule of their schema node or of a node below it."""
    for v, version in enumerate(crd["spec"]["versions"]):
        base = f"spec.versions[{v}].schema.openAPIV3Schema"
        schema = version["schema"]["openAPIV3Schema"]
        broken = list(compile_failures(schema, base))
        yield from broken
        if broken:
            continue
        for path, node in defaults(schema, base):
            shown = json.dumps(node["default"], sort_keys=True)
            for failure in rule_failures(node, node["default"], root=False):
                where = path if failure.path == "<root>" else f"{path}.{failure.path}"
                yield f"{where}: Invalid value: {shown}: {failure.detail}"
