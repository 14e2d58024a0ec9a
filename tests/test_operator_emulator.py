"""The API emulator models what docs/operator.md says it models (the integration test relies on
it): status subresource, generation, no-op writes, finalizers, owner-reference GC, patches,
CRD defaulting, CEL validation rules (and the CRD-creation check of defaults), Pod Security
admission, and list + watch from a resourceVersion over HTTP."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kube_emulator import KubeEmulator
from kube_emulator.errors import ApiError
from kube_emulator.fixtures import CRD_PATH
from kube_emulator.schema import load_crd
from kube_emulator.server import BUILTIN, crd_types
from kube_emulator.store import CRD_KEY, ObjectStore

MERGE = "application/merge-patch+json"


@pytest.fixture(scope="module")
def emulator() -> Iterator[KubeEmulator]:
    emu = KubeEmulator([CRD_PATH])
    emu.start()
    yield emu
    emu.call(lambda store: store.check_invariants())
    emu.stop()


def run(emu: KubeEmulator, steps: Any) -> Any:
    """Run `steps(store, types)` on the emulator's loop (the store is not thread-safe)."""
    return emu.call(lambda store: steps(store, store.types))


def tsvc(name: str) -> dict[str, Any]:
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "TandemService",
            "metadata": {"name": name}, "spec": {"cells": 1}}


def test_custom_resources_are_defaulted_validated_and_pruned(emulator: KubeEmulator) -> None:
    def steps(store: ObjectStore, types: dict) -> Any:
        t = types["tandem.dev/tandemservices"]
        obj = store.create(t, "ns", {**tsvc("a"), "status": {"x": 1}, "spec": {"junk": 1}})
        with pytest.raises(ApiError) as bad:
            store.create(t, "ns", {**tsvc("b"), "spec": {"cells": -1}})
        return obj, bad.value
    obj, bad = run(emulator, steps)
    assert obj["spec"]["featureCache"]["size"] == "4Gi" and "junk" not in obj["spec"]
    assert "status" not in obj  # status only through /status
    assert bad.code == 422 and "spec.cells" in bad.message


def test_cel_rules_refuse_writes_with_422_and_the_rules_message(emulator: KubeEmulator) -> None:
    def steps(store: ObjectStore, types: dict) -> Any:
        t = types["tandem.dev/tandemservices"]
        with pytest.raises(ApiError) as created:
            store.create(t, "ns", {**tsvc("tp"), "spec": {
                "worker": {"workersPerCell": 3, "tensorParallelSize": 2}}})
        store.create(t, "ns", tsvc("ok"))
        with pytest.raises(ApiError) as patched:
            store.patch(t, "ns", "ok", MERGE, {"spec": {"model": {"claimName": "models"}}})
        with pytest.raises(ApiError) as named:
            store.create(t, "ns", tsvc("a" * 40))
        return created.value, patched.value, named.value, store.get(t, "ns", "ok")
    created, patched, named, kept = run(emulator, steps)
    assert (created.code, created.reason) == (422, "Invalid")
    assert created.message == (
        'TandemService.tandem.dev "tp" is invalid: spec.worker: Invalid value: "object": '
        "workersPerCell must be a multiple of tensorParallelSize")
    assert patched.code == 422 and "spec.model: Invalid value" in patched.message
    assert "claimName" not in kept["spec"]["model"]
    assert "<root>: Invalid value" in named.message and "at most 39" in named.message


def crd_store(cel_validation: bool) -> ObjectStore:
    return ObjectStore(BUILTIN + crd_types(load_crd(CRD_PATH)), cel_validation)


def test_a_crd_whose_default_breaks_a_rule_is_refused() -> None:
    """The apiserver checks each default against its node's rules as written (`{}` here)."""
    crd = load_crd(CRD_PATH)
    scheduler = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["scheduler"]
    scheduler["x-kubernetes-validations"][0]["rule"] = "!(self.port in [9400, 9401, 50061])"
    store = crd_store(cel_validation=True)
    with pytest.raises(ApiError) as refused:
        store.create(store.types[CRD_KEY], "", crd)
    assert refused.value.code == 422
    assert ("properties[spec].properties[scheduler].default: Invalid value: {}: no such key: "
            "port evaluating rule: port must not be") in refused.value.message
    store.create(store.types[CRD_KEY], "", load_crd(CRD_PATH))  # the CRD as it is passes


def test_without_cel_validation_the_rules_are_dropped() -> None:
    store = crd_store(cel_validation=False)
    t = store.types["tandem.dev/tandemservices"]
    obj = store.create(t, "ns", {**tsvc("a" * 44), "spec": {"model": {"claimName": "models"}}})
    assert obj["spec"]["model"] == {"name": "tiny", "claimName": "models"}
    with pytest.raises(ApiError) as structural:  # the structural schema still holds
        store.create(t, "ns", {**tsvc("b"), "spec": {"cells": 65}})
    assert "spec.cells" in structural.value.message


def test_status_generation_and_no_op_writes(emulator: KubeEmulator) -> None:
    def steps(store: ObjectStore, types: dict) -> Any:
        t = types["tandem.dev/tandemservices"]
        store.create(t, "ns", tsvc("c"))
        s1 = store.patch(t, "ns", "c", MERGE, {"status": {"replicas": 1}}, "status")
        s2 = store.patch(t, "ns", "c", MERGE, {"status": {"replicas": 5}})  # ignored
        s3 = store.patch(t, "ns", "c", MERGE, {"spec": {"cells": 2}})
        s4 = store.patch(t, "ns", "c", MERGE, {"spec": {"cells": 2}})  # no-op
        return s1, s2, s3, s4
    s1, s2, s3, s4 = run(emulator, steps)
    assert s1["status"] == {"replicas": 1} and s1["metadata"]["generation"] == 1
    assert s2["status"] == {"replicas": 1}
    assert s3["metadata"]["generation"] == 2
    assert s4["metadata"]["resourceVersion"] == s3["metadata"]["resourceVersion"]


def test_finalizers_hold_deletion_and_owners_collect_dependents(emulator: KubeEmulator) -> None:
    def steps(store: ObjectStore, types: dict) -> Any:
        t, cm = types["tandem.dev/tandemservices"], types["/configmaps"]
        owner = store.create(t, "ns", {**tsvc("d"), "metadata": {
            "name": "d", "finalizers": ["tandem.dev/finalizer"]}})
        ref = {"apiVersion": "tandem.dev/v1alpha1", "kind": "TandemService", "name": "d",
               "uid": owner["metadata"]["uid"], "controller": True}
        store.create(cm, "ns", {"metadata": {"name": "child", "ownerReferences": [ref]}})
        held = store.delete(t, "ns", "d")
        child_kept = bool(store.list(cm, "ns"))
        with pytest.raises(ApiError):  # a failed JSON-patch test changes nothing
            store.patch(t, "ns", "d", "application/json-patch+json", [
                {"op": "test", "path": "/metadata/resourceVersion", "value": "0"},
                {"op": "remove", "path": "/metadata/finalizers/0"}])
        store.patch(t, "ns", "d", "application/json-patch+json", [
            {"op": "remove", "path": "/metadata/finalizers/0"}])
        return held, child_kept, store.list(t, "ns"), store.list(cm, "ns")
    held, child_kept, left, children = run(emulator, steps)
    assert held["metadata"]["deletionTimestamp"] and child_kept
    assert all(o["metadata"]["name"] != "d" for o in left)
    assert children == []


def test_statefulset_pods_jobs_and_pod_security(emulator: KubeEmulator) -> None:
    def steps(store: ObjectStore, types: dict) -> Any:
        sts, pods, jobs, nss = (types[k] for k in (
            "apps/statefulsets", "/pods", "batch/jobs", "/namespaces"))
        pin = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}}}
        template = {"metadata": {"labels": {"app": "w"}}, "spec": {
            "affinity": pin, "containers": [{"name": "c", "image": "i"}],
            "volumes": [{"name": "v", "hostPath": {"path": "/x"}}]}}
        store.create(sts, "ps", {"metadata": {"name": "w"}, "spec": {
            "replicas": 2, "selector": {"matchLabels": {"app": "w"}}, "template": template}})
        made = store.list(pods, "ps")
        store.delete(pods, "ps", "w-0")  # the controller brings it back
        back = store.get(pods, "ps", "w-0")
        job = store.create(jobs, "ps", {"metadata": {"name": "j"}, "spec": {"template": template}})
        store.create(nss, "", {"metadata": {"name": "locked", "labels": {
            "pod-security.kubernetes.io/enforce": "baseline"}}})
        with pytest.raises(ApiError) as refused:
            store.create(pods, "locked", {"metadata": {"name": "p"}, "spec": template["spec"]},
                         dry_run=True)
        return made, back, store.get(jobs, "ps", job["metadata"]["name"]), refused.value
    made, back, job, refused = run(emulator, steps)
    assert [(p["metadata"]["name"], p["spec"]["nodeName"]) for p in made] == [
        ("w-0", "n1"), ("w-1", "n1")]
    assert made[1]["metadata"]["labels"]["apps.kubernetes.io/pod-index"] == "1"
    assert back["metadata"]["uid"] != made[0]["metadata"]["uid"]
    assert {"type": "Ready", "status": "True"}.items() <= back["status"]["conditions"][1].items()
    assert job["status"]["succeeded"] == 1
    assert refused.code == 403 and "violates PodSecurity" in refused.message


def test_list_then_watch_from_the_resource_version_over_http(emulator: KubeEmulator) -> None:
    base = f"{emulator.url}/api/v1/namespaces/w/configmaps"
    with urllib.request.urlopen(base) as reply:
        listed = json.load(reply)
    rv = listed["metadata"]["resourceVersion"]

    def steps(store: ObjectStore, types: dict) -> None:
        for name, labels in (("one", {"k": "a"}), ("two", {"k": "b"})):
            store.create(types["/configmaps"], "w", {"metadata": {"name": name,
                                                                  "labels": labels}})
    run(emulator, steps)
    query = f"?watch=true&resourceVersion={rv}&timeoutSeconds=1&labelSelector=k%3Db"
    with urllib.request.urlopen(base + query) as reply:
        events = [json.loads(line) for line in reply.read().splitlines()]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "two")]
