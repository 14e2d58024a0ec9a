"""Structural-schema behaviour of CRDs: defaulting, pruning and validation.

Used by the emulator (what the apiserver does to a custom resource on every write) and by the
CRD tests (every example must validate). Validation goes through `jsonschema` after a small
conversion of the Kubernetes extensions; CEL rules (x-kubernetes-validations) are evaluated by
kube_emulator.cel.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml

Schema = dict[str, Any]


def load_crd(path: str | Path) -> dict[str, Any]:
    crd = yaml.safe_load(Path(path).read_text())
    assert crd["kind"] == "CustomResourceDefinition", path
    return crd


def version_schema(crd: dict[str, Any], version: str | None = None) -> Schema:
    """openAPIV3Schema of `version`, or of the storage version."""
    for v in crd["spec"]["versions"]:
        if v["name"] == version or (version is None and v.get("storage")):
            schema: Schema = v["schema"]["openAPIV3Schema"]
            return schema
    raise KeyError(version)


def apply_defaults(schema: Schema, value: Any) -> None:
    """Fill absent fields with their defaults, top-down, so a defaulted `{}` gets its own
    nested defaults too (what the apiserver does)."""
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in set(value) - set(schema.get("properties") or {}):
                apply_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(schema["items"], item)


def prune(schema: Schema, value: Any) -> None:
    """Drop fields the schema does not declare (the apiserver prunes them silently)."""
    if isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is not None and not extra:
            for key in [k for k in value if k not in props]:
                del value[key]
        for key, item in value.items():
            sub = (props or {}).get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                prune(sub, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            prune(schema["items"], item)


def to_json_schema(schema: Schema, strict: bool = True) -> Schema:
    """Translate the Kubernetes extensions; `strict` also forbids undeclared fields (what
    `kubectl apply` with server-side field validation reports as an error)."""
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if schema.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in out:
        out["properties"] = {k: to_json_schema(v, strict) for k, v in out["properties"].items()}
        if strict and "additionalProperties" not in out and not schema.get(
                "x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = to_json_schema(out[key], strict)
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [to_json_schema(s, strict) for s in out[key]]
    return out


def validation_errors(schema: Schema, obj: Any, strict: bool = True) -> Iterator[str]:
    """Messages `<path>: <problem>` for every violation, for apiserver-style 422 answers."""
    validator = jsonschema.Draft202012Validator(to_json_schema(schema, strict))
    for error in validator.iter_errors(obj):
        path = ".".join(str(p) for p in error.absolute_path) or "<root>"
        yield f"{path}: {error.message}"


def cel_rules(schema: Schema, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, rule) of every CEL rule, for tests that mirror them."""
    for rule in schema.get("x-kubernetes-validations") or ():
        yield path or "<root>", rule["rule"]
    for key, sub in (schema.get("properties") or {}).items():
        yield from cel_rules(sub, f"{path}.{key}" if path else key)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from cel_rules(schema[key], f"{path or '<root>'}[*]")


def defaults(schema: Schema, path: str) -> Iterator[tuple[str, Schema]]:
    """(path, node) of every schema node with a default, paths as the apiserver writes them
    (`<path>.properties[spec].properties[worker].default`)."""
    if "default" in schema:
        yield f"{path}.default", schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from defaults(sub, f"{path}.properties[{key}]")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from defaults(schema[key], f"{path}.{key}")


def default_errors(crd: dict[str, Any]) -> Iterator[str]:
    """Defaults that do not validate against their own schema node, unknown fields included
    (the apiserver's structural check on CRD creation; its CEL part is in kube_emulator.cel)."""
    for v, version in enumerate(crd["spec"]["versions"]):
        base = f"spec.versions[{v}].schema.openAPIV3Schema"
        for path, node in defaults(version["schema"]["openAPIV3Schema"], base):
            for error in validation_errors(node, node["default"]):
                where, _, problem = error.partition(": ")
                yield f"{path if where == '<root>' else f'{path}.{where}'}: {problem}"
