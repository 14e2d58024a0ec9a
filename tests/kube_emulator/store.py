"""The emulator's storage: objects, one resourceVersion counter, the watch event log, and the
apiserver semantics that operators depend on (status subresource, generation, finalizers,
owner-reference garbage collection, optimistic concurrency, CRD defaulting and validation, CEL
validation rules, the CRD-creation check of defaults).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import secrets
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kube_emulator.cel import default_failures, rule_failures
from kube_emulator.errors import ApiError
from kube_emulator.patches import apply_json_patch, merge_patch
from kube_emulator.schema import apply_defaults, default_errors, prune, validation_errors
from kube_emulator.selectors import matches

Obj = dict[str, Any]
CRD_KEY = "apiextensions.k8s.io/customresourcedefinitions"


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: tuple[str, ...] = ()
    schema: dict[str, Any] | None = None  # openAPIV3Schema of a CRD
    short_names: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        return f"{self.group}/{self.plural}"


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def invalid(rt: ResourceType, name: str, errors: list[str]) -> ApiError:
    """The apiserver's 422 answer: `<Kind>.<group> "<name>" is invalid: <errors>`."""
    kind = f"{rt.kind}.{rt.group}" if rt.group else rt.kind
    shown = errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {shown}')


def _essence(obj: Obj) -> Obj:
    """The object without the fields the server maintains, to detect no-op writes."""
    out = copy.deepcopy(obj)
    out.get("metadata", {}).pop("resourceVersion", None)
    out.get("metadata", {}).pop("managedFields", None)
    return out


class ObjectStore:
    """All objects of the emulated cluster plus the ordered log of watch events.

    Invariants: `rv` is the largest resourceVersion ever issued; every stored object's
    metadata.resourceVersion is a distinct decimal <= rv; the event log is in strictly
    increasing resourceVersion order and its last entry describes the current state of its
    object; uids are unique; a stored object with a deletionTimestamp has finalizers (without
    them it is removed at once). Only the methods below mutate `objects` and `log`.

    `cel_validation` False models an apiserver that drops CEL rules (before Kubernetes 1.25, or
    1.25-1.28 with the CustomResourceValidationExpressions feature gate off).
    """

    def __init__(self, types: Iterable[ResourceType], cel_validation: bool = True) -> None:
        self.types = {t.key: t for t in types}
        self.cel_validation = cel_validation
        self.objects: dict[tuple[str, str, str], Obj] = {}
        self.log: list[tuple[int, str, str, Obj]] = []  # (rv, type, resource key, object)
        self.rv = 0
        self.admission: list[Callable[[ObjectStore, ResourceType, Obj], None]] = []
        self.reactors: list[Callable[[ObjectStore, ResourceType, str, Obj], None]] = []
        self._changed = asyncio.Event()
        self._queue: list[tuple[ResourceType, str, Obj]] = []
        self._draining = False

    def check_invariants(self) -> None:
        rvs = [int(o["metadata"]["resourceVersion"]) for o in self.objects.values()]
        assert len(rvs) == len(set(rvs)) and all(rv <= self.rv for rv in rvs)
        log_rvs = [rv for rv, *_ in self.log]
        assert log_rvs == sorted(set(log_rvs)) and (not log_rvs or log_rvs[-1] == self.rv)
        uids = [o["metadata"]["uid"] for o in self.objects.values()]
        assert len(uids) == len(set(uids))
        for obj in self.objects.values():
            meta = obj["metadata"]
            assert not meta.get("deletionTimestamp") or meta.get("finalizers"), meta["name"]

    # -- reads --------------------------------------------------------------------------

    def get(self, rt: ResourceType, namespace: str, name: str) -> Obj:
        obj = self.objects.get((rt.key, namespace, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{rt.plural}.{rt.group} "{name}" not found')
        return copy.deepcopy(obj)

    def list(self, rt: ResourceType, namespace: str | None, selector: str = "") -> list[Obj]:
        return [copy.deepcopy(o) for (key, ns, _), o in sorted(self.objects.items())
                if key == rt.key and namespace in (None, ns) and matches(selector, o)]

    def events_after(self, rv: int, rt: ResourceType, namespace: str | None,
                     selector: str) -> list[tuple[int, str, Obj]]:
        return [(r, kind, copy.deepcopy(o)) for r, kind, key, o in self.log
                if r > rv and key == rt.key and namespace in (None, o["metadata"].get("namespace"))
                and matches(selector, o)]

    async def wait_for_change(self, timeout: float) -> None:
        """Return after the next write, or raise TimeoutError."""
        await asyncio.wait_for(self._changed.wait(), timeout)

    # -- writes -------------------------------------------------------------------------

    def _commit(self, rt: ResourceType, kind: str, obj: Obj) -> Obj:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        key = (rt.key, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        if kind == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        self.log.append((self.rv, kind, rt.key, copy.deepcopy(obj)))
        self._changed.set()
        self._changed = asyncio.Event()
        self._queue.append((rt, kind, copy.deepcopy(obj)))
        self._drain()
        return copy.deepcopy(obj)

    def _drain(self) -> None:
        """Run the controllers on each committed change, one at a time: a write made by a
        controller is queued behind the one it reacts to, never nested inside it."""
        if self._draining:
            return
        self._draining = True
        try:
            while self._queue:
                rt, kind, obj = self._queue.pop(0)
                for react in self.reactors:
                    react(self, rt, kind, obj)
        finally:
            self._draining = False

    def _admit(self, rt: ResourceType, obj: Obj) -> None:
        name = obj["metadata"].get("name", "")
        if rt.key == CRD_KEY:  # every default must pass its schema node, and its rules
            errors = list(default_errors(obj))
            if self.cel_validation and not errors:
                errors = list(default_failures(obj))
            if errors:
                raise invalid(rt, name, errors)
        if rt.schema is not None:
            apply_defaults(rt.schema, obj)
            prune(rt.schema, obj)
            errors = list(validation_errors(rt.schema, obj, strict=False))
            if self.cel_validation and not errors:
                errors = [str(f) for f in rule_failures(rt.schema, obj)]
            if errors:
                raise invalid(rt, name, errors)
        for check in self.admission:
            check(self, rt, obj)

    def create(self, rt: ResourceType, namespace: str, obj: Obj, dry_run: bool = False) -> Obj:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        if not meta.get("name"):
            raise ApiError(422, "Invalid", "metadata.name: Required value")
        if rt.namespaced:
            meta["namespace"] = namespace
        if (rt.key, namespace if rt.namespaced else "", meta["name"]) in self.objects:
            raise ApiError(409, "AlreadyExists",
                           f'{rt.plural}.{rt.group} "{meta["name"]}" already exists')
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
        meta.pop("resourceVersion", None)
        if "status" in rt.subresources:
            obj.pop("status", None)
        self._admit(rt, obj)
        return copy.deepcopy(obj) if dry_run else self._commit(rt, "ADDED", obj)

    def update(self, rt: ResourceType, namespace: str, name: str, new: Obj,
               subresource: str = "") -> Obj:
        """Replace (PUT) the object or its status; patches end here too."""
        old = self.get(rt, namespace, name)
        sent_rv = new.get("metadata", {}).get("resourceVersion")
        if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rt.plural} '
                                            f'"{name}": the object has been modified')
        merged = copy.deepcopy(new)
        merged["metadata"] = {**new.get("metadata", {}), **{
            k: old["metadata"][k] for k in ("uid", "creationTimestamp", "generation", "name",
                                            "namespace", "deletionTimestamp")
            if k in old["metadata"]}}
        if subresource == "status":  # only status changes through /status
            merged = {**old, "status": new.get("status")}
        elif "status" in rt.subresources:  # and status never changes through the object
            merged["status"] = old.get("status")
            if merged["status"] is None:
                merged.pop("status")
        self._admit(rt, merged)
        if _essence(merged) == _essence(old):
            return old  # no-op writes issue no resourceVersion and no event
        if {k: v for k, v in merged.items() if k not in ("metadata", "status")} != {
                k: v for k, v in old.items() if k not in ("metadata", "status")}:
            merged["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        if merged["metadata"].get("deletionTimestamp") and not merged["metadata"].get(
                "finalizers"):
            return self._remove(rt, merged)
        return self._commit(rt, "MODIFIED", merged)

    def patch(self, rt: ResourceType, namespace: str, name: str, content_type: str,
              body: Any, subresource: str = "") -> Obj:
        old = self.get(rt, namespace, name)
        if content_type.startswith("application/json-patch+json"):
            new = apply_json_patch(old, body)
        elif content_type.startswith(("application/merge-patch+json",
                                      "application/strategic-merge-patch+json")):
            new = merge_patch(old, body)
        else:
            raise ApiError(415, "UnsupportedMediaType", f"patch type {content_type}")
        return self.update(rt, namespace, name, new, subresource)

    def delete(self, rt: ResourceType, namespace: str, name: str) -> Obj:
        obj = self.get(rt, namespace, name)
        if obj["metadata"].get("finalizers"):
            if obj["metadata"].get("deletionTimestamp"):
                return obj
            obj["metadata"]["deletionTimestamp"] = now()
            return self._commit(rt, "MODIFIED", obj)
        return self._remove(rt, obj)

    def _remove(self, rt: ResourceType, obj: Obj) -> Obj:
        """Remove, then collect the dependents (background propagation, done at once)."""
        gone = self._commit(rt, "DELETED", obj)
        uid = obj["metadata"]["uid"]
        for (key, ns, name), child in list(self.objects.items()):
            if any(ref.get("uid") == uid for ref in child["metadata"].get("ownerReferences", ())):
                with contextlib.suppress(ApiError):  # removed meanwhile by an earlier cascade
                    self.delete(self.types[key], ns, name)
        return gone
