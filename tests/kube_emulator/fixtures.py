"""Objects the operator's tests build again and again: defaulted TandemService specs (through
the CRD's own defaults, as the apiserver would apply them), nodes and pods."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from kube_emulator.patches import merge_patch
from kube_emulator.schema import apply_defaults, load_crd, version_schema
from tandem_operator.spec import TandemSpec, parse_spec

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "charts" / "tandem" / "crds" / "tandemservices.tandem.dev.yaml"
SCHEMA = version_schema(load_crd(CRD_PATH))


def defaulted_spec(patch: dict[str, Any] | None = None) -> dict[str, Any]:
    """`spec` after the apiserver's defaulting of `patch` (a merge patch over `{}`)."""
    obj = {"apiVersion": "tandem.dev/v1alpha1", "kind": "TandemService",
           "metadata": {"name": "demo"}, "spec": merge_patch({}, patch or {})}
    apply_defaults(SCHEMA, obj)
    spec: dict[str, Any] = obj["spec"]
    return spec


def tandem_spec(patch: dict[str, Any] | None = None, name: str = "demo",
                namespace: str = "serving") -> TandemSpec:
    return parse_spec(name, namespace, defaulted_spec(patch))


def node(name: str, cpu: str = "16", memory: str = "64Gi", gpus: int = 4,
         labels: dict[str, str] | None = None, taints: list[dict[str, str]] | None = None,
         ready: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "spec": {"taints": copy.deepcopy(taints)} if taints else {},
        "status": {"allocatable": {"cpu": cpu, "memory": memory, "nvidia.com/gpu": str(gpus),
                                   "pods": "110"},
                   "conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def pod(name: str, node_name: str, requests: dict[str, str], labels: dict[str, str] | None = None,
        namespace: str = "other") -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
        "spec": {"nodeName": node_name,
                 "containers": [{"name": "c", "image": "x", "resources": {"requests": requests}}]},
        "status": {"phase": "Running"},
    }
