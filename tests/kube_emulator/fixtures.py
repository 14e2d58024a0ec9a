"""Objects the operator's tests build again and again: defaulted TandemService specs (through
the CRD's own defaults, as the apiserver would apply them), nodes and pods; and the writes the
endpoint picker's pool tests make over HTTP (`ClusterWriter`)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kube_emulator.patches import merge_patch
from kube_emulator.schema import apply_defaults, load_crd, version_schema
from kube_emulator.server import KubeEmulator
from tandem_operator.spec import TandemSpec, parse_spec

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "charts" / "tandem" / "crds" / "tandemservices.tandem.dev.yaml"
GIE_CRD_PATH = REPO / "tests" / "data" / "gie" / "inference.networking.k8s.io_inferencepools.yaml"
MERGE = {"Content-Type": "application/merge-patch+json"}
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


class ClusterWriter:
    """Writes to the emulator's HTTP API in one namespace, as the operator (InferencePools)
    and the kubelet (a pod created, then Ready through its status subresource, at an IP of
    the test's choosing) would."""

    def __init__(self, url: str, namespace: str) -> None:
        self.http = httpx.Client(base_url=url)
        self.pools = f"/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools"
        self.pods = f"/api/v1/namespaces/{namespace}/pods"

    def close(self) -> None:
        self.http.close()

    def _ok(self, reply: httpx.Response) -> None:
        assert reply.status_code in (200, 201), reply.text

    def pool(self, name: str, port: int, labels: dict[str, str]) -> None:
        """Create or update an InferencePool selecting `labels` at `port`."""
        body = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                "metadata": {"name": name},
                "spec": {"selector": {"matchLabels": labels}, "targetPorts": [{"number": port}],
                         "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}
        if self.http.get(f"{self.pools}/{name}").status_code == 404:
            self._ok(self.http.post(self.pools, json=body))
        else:
            self._ok(self.http.patch(f"{self.pools}/{name}", json=body, headers=MERGE))

    def pod(self, name: str, labels: dict[str, str], ip: str, ready: bool = True) -> None:
        """Create the pod if it is new, then set its status: Running at `ip`, Ready or not."""
        if self.http.get(f"{self.pods}/{name}").status_code == 404:
            self._ok(self.http.post(self.pods, json={
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
                "spec": {"containers": [{"name": "scheduler", "image": "tandem"}]}}))
        status = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                  "conditions": [{"type": "Ready", "status": str(ready)}]}
        self._ok(self.http.patch(f"{self.pods}/{name}/status", json={"status": status},
                                 headers=MERGE))

    def delete(self, path: str) -> None:
        self._ok(self.http.delete(path))


@dataclass
class Cluster:
    emulator: KubeEmulator
    kubeconfig: Path
    write: ClusterWriter  # in `namespace`
    namespace: str


@contextlib.contextmanager
def emulated_cluster(tmp: Path, namespace: str = "serving") -> Iterator[Cluster]:
    """The API emulator serving InferencePools, a kubeconfig for it, and its writer."""
    emulator = KubeEmulator([CRD_PATH, GIE_CRD_PATH])
    emulator.start()
    writer = ClusterWriter(emulator.url, namespace)
    try:
        yield Cluster(emulator, emulator.write_kubeconfig(tmp / "kubeconfig"), writer,
                      namespace)
    finally:
        writer.close()
        emulator.stop()
