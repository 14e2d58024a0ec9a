"""The cluster behaviour beyond the apiserver that the operator's tests need, reduced to the
outcome: the StatefulSet controller and kube-scheduler (pods exist, bound to the node their
required node affinity names, and Ready at once, their IP loopback: a test serves there what
the pod would), the Deployment controller (every replica
available at once, without pods), the Job controller and kubelet (a Job completes at once),
and Pod Security admission (hostPath refused below `privileged`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kube_emulator.errors import ApiError
from kube_emulator.store import ObjectStore, ResourceType, now

Obj = dict[str, Any]
POD_INDEX = "apps.kubernetes.io/pod-index"
POD_IP = "127.0.0.1"
REVISION = "controller-revision-hash"


def _type(store: ObjectStore, key: str) -> ResourceType:
    return store.types[key]


def pinned_node(pod_spec: Obj) -> str:
    """The node a pod must run on: spec.nodeName, else the first node its required node
    affinity names (matchFields on metadata.name, or a kubernetes.io/hostname expression)."""
    if pod_spec.get("nodeName"):
        return str(pod_spec["nodeName"])
    required = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    for term in required.get("nodeSelectorTerms") or ():
        for expr in (term.get("matchFields") or []) + (term.get("matchExpressions") or []):
            if expr["key"] in ("metadata.name", "kubernetes.io/hostname") and expr.get("values"):
                return str(expr["values"][0])
    return ""


def _pod_for(sts: Obj, ordinal: int, revision: str) -> Obj:
    template = sts["spec"]["template"]
    meta = sts["metadata"]
    name = f"{meta['name']}-{ordinal}"
    spec = json.loads(json.dumps(template["spec"]))
    spec["nodeName"] = pinned_node(spec)
    return {
        "metadata": {
            "name": name,
            "labels": {**template["metadata"].get("labels", {}), POD_INDEX: str(ordinal),
                       REVISION: revision, "statefulset.kubernetes.io/pod-name": name},
            "annotations": dict(template["metadata"].get("annotations") or {}),
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet",
                                 "name": meta["name"], "uid": meta["uid"], "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "spec": spec,
    }


def _running(pod: Obj) -> Obj:
    scheduled = bool(pod["spec"].get("nodeName"))
    address = {"podIP": POD_IP, "podIPs": [{"ip": POD_IP}]} if scheduled else {}
    conditions = [{"type": "PodScheduled", "status": str(scheduled)},
                  {"type": "Ready", "status": str(scheduled), "lastTransitionTime": now()}]
    return {"phase": "Running" if scheduled else "Pending", "startTime": now(), **address,
            "conditions": conditions}


def sync_statefulset(store: ObjectStore, sts: Obj) -> None:
    """Make the pods match the template: missing ordinals created, pods of another revision
    replaced, surplus ordinals deleted (all at once; no ordered rollout)."""
    pods_t = _type(store, "/pods")
    meta = sts["metadata"]
    revision = hashlib.sha256(json.dumps(sts["spec"]["template"], sort_keys=True).encode())
    revision_hash = revision.hexdigest()[:10]
    replicas = sts["spec"].get("replicas", 1)
    owned = {p["metadata"]["name"]: p for p in store.list(pods_t, meta["namespace"])
             if any(r.get("uid") == meta["uid"] for r in p["metadata"].get("ownerReferences", ()))}
    for name, pod in owned.items():
        ordinal = int(pod["metadata"]["labels"].get(POD_INDEX, "-1"))
        if ordinal >= replicas or pod["metadata"]["labels"].get(REVISION) != revision_hash:
            store.delete(pods_t, meta["namespace"], name)
    for ordinal in range(replicas):
        name = f"{meta['name']}-{ordinal}"
        try:
            store.get(pods_t, meta["namespace"], name)
            continue
        except ApiError:
            pass
        try:
            pod = store.create(pods_t, meta["namespace"], _pod_for(sts, ordinal, revision_hash))
        except ApiError as e:  # what the real controller reports as an Event
            _event(store, sts, "FailedCreate", e.message)
            continue
        store.update(pods_t, meta["namespace"], name, {**pod, "status": _running(pod)}, "status")
    ready = sum(1 for p in store.list(pods_t, meta["namespace"])
                if p["metadata"].get("ownerReferences", [{}])[0].get("uid") == meta["uid"])
    status = {"replicas": ready, "readyReplicas": ready, "currentReplicas": ready,
              "updatedReplicas": ready, "observedGeneration": meta.get("generation", 1),
              "currentRevision": revision_hash, "updateRevision": revision_hash}
    store.update(_type(store, "apps/statefulsets"), meta["namespace"], meta["name"],
                 {**sts, "status": status}, "status")


def _event(store: ObjectStore, about: Obj, reason: str, message: str) -> None:
    meta = about["metadata"]
    store.create(_type(store, "/events"), meta["namespace"], {
        "metadata": {"generateName": f"{meta['name']}."},
        "involvedObject": {"apiVersion": about.get("apiVersion"), "kind": about.get("kind"),
                           "name": meta["name"], "namespace": meta["namespace"],
                           "uid": meta["uid"]},
        "reason": reason, "message": message, "type": "Warning",
        "source": {"component": "emulator"}, "firstTimestamp": now(), "lastTimestamp": now()})


def complete_job(store: ObjectStore, job: Obj) -> None:
    stamp = now()
    status = {"startTime": stamp, "completionTime": stamp, "succeeded": 1, "conditions": [
        {"type": "Complete", "status": "True", "lastTransitionTime": stamp}]}
    meta = job["metadata"]
    store.update(_type(store, "batch/jobs"), meta["namespace"], meta["name"],
                 {**job, "status": status}, "status")


def roll_out(store: ObjectStore, deployment: Obj) -> None:
    meta, replicas = deployment["metadata"], deployment["spec"].get("replicas", 1)
    status = {"replicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas,
              "updatedReplicas": replicas, "observedGeneration": meta.get("generation", 1)}
    store.update(_type(store, "apps/deployments"), meta["namespace"], meta["name"],
                 {**deployment, "status": status}, "status")


def react(store: ObjectStore, rt: ResourceType, kind: str, obj: Obj) -> None:
    """The reactor the store calls after each committed change."""
    meta = obj["metadata"]
    if rt.key == "apps/statefulsets" and kind in ("ADDED", "MODIFIED"):
        if not obj.get("status") or obj["status"].get("observedGeneration") != meta["generation"]:
            sync_statefulset(store, obj)
    elif rt.key == "apps/deployments" and kind in ("ADDED", "MODIFIED"):
        if (obj.get("status") or {}).get("observedGeneration") != meta["generation"]:
            roll_out(store, obj)
    elif rt.key == "batch/jobs" and kind == "ADDED":
        complete_job(store, obj)
    elif rt.key == "/pods" and kind == "DELETED":
        for ref in meta.get("ownerReferences") or ():
            if ref.get("kind") == "StatefulSet":
                try:
                    owner = store.get(_type(store, "apps/statefulsets"), meta["namespace"],
                                      ref["name"])
                except ApiError:
                    continue
                if owner["metadata"]["uid"] == ref.get("uid"):
                    sync_statefulset(store, owner)


def pod_security(store: ObjectStore, rt: ResourceType, obj: Obj) -> None:
    """Admission: a namespace enforcing `baseline` or `restricted` refuses hostPath volumes."""
    if rt.key != "/pods":
        return
    try:
        ns = store.get(_type(store, "/namespaces"), "", obj["metadata"]["namespace"])
    except ApiError:
        return
    level = (ns["metadata"].get("labels") or {}).get("pod-security.kubernetes.io/enforce")
    host_paths = [v["name"] for v in obj["spec"].get("volumes") or () if "hostPath" in v]
    if level in ("baseline", "restricted") and host_paths:
        volumes = ", ".join(f'"{v}"' for v in host_paths)
        raise ApiError(403, "Forbidden", f'pods "{obj["metadata"]["name"]}" is forbidden: '
                                         f'violates PodSecurity "{level}:latest": hostPath '
                                         f'volumes (volumes {volumes})')
