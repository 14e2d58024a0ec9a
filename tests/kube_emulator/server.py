"""The emulator's HTTP front: discovery, CRUD, patch, watch, on 127.0.0.1 in its own thread.

Real clients talk to it unchanged: kopf (list + watch + patch + events) and the official
`kubernetes` client the operator uses, both through a kubeconfig that `write_kubeconfig` makes.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from aiohttp import web

from kube_emulator.controllers import pod_security, react
from kube_emulator.errors import ApiError
from kube_emulator.schema import load_crd
from kube_emulator.store import ObjectStore, ResourceType

T = TypeVar("T")
BUILTIN = [
    ResourceType("", "v1", "namespaces", "Namespace", False, ("status",), short_names=("ns",)),
    ResourceType("", "v1", "nodes", "Node", False, ("status",), short_names=("no",)),
    ResourceType("", "v1", "pods", "Pod", True, ("status",), short_names=("po",)),
    ResourceType("", "v1", "configmaps", "ConfigMap", True, short_names=("cm",)),
    ResourceType("", "v1", "services", "Service", True, ("status",), short_names=("svc",)),
    ResourceType("", "v1", "events", "Event", True, short_names=("ev",)),
    ResourceType("apps", "v1", "statefulsets", "StatefulSet", True, ("status", "scale")),
    ResourceType("apps", "v1", "deployments", "Deployment", True, ("status", "scale"),
                 short_names=("deploy",)),
    ResourceType("batch", "v1", "jobs", "Job", True, ("status",)),
    ResourceType("", "v1", "serviceaccounts", "ServiceAccount", True, short_names=("sa",)),
    ResourceType("rbac.authorization.k8s.io", "v1", "roles", "Role", True),
    ResourceType("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", True),
    ResourceType("apiextensions.k8s.io", "v1", "customresourcedefinitions",
                 "CustomResourceDefinition", False, ("status",), short_names=("crd",)),
]


def crd_types(crd: dict[str, Any]) -> list[ResourceType]:
    spec = crd["spec"]
    names = spec["names"]
    return [ResourceType(spec["group"], v["name"], names["plural"], names["kind"],
                         spec["scope"] == "Namespaced", tuple(v.get("subresources") or {}),
                         v["schema"]["openAPIV3Schema"], tuple(names.get("shortNames") or ()))
            for v in spec["versions"] if v.get("served")]


class KubeEmulator:
    """An API server for tests: start() in a background thread, stop() when done.

    `call(fn)` runs `fn(store)` on the server's loop, for tests that inspect or seed the
    store directly (the store is not thread-safe; everything else goes through HTTP).
    `cel_validation=False` is a cluster whose apiserver drops CRD validation rules.
    """

    def __init__(self, crd_paths: list[Path], cel_validation: bool = True) -> None:
        self.crds = [load_crd(p) for p in crd_paths]
        self.cel_validation = cel_validation
        types = BUILTIN + [t for crd in self.crds for t in crd_types(crd)]
        self.types = types
        self.store: ObjectStore | None = None
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._watches: set[asyncio.Task[Any]] = set()

    def start(self) -> str:
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self.url

    async def _start(self) -> str:
        self.store = ObjectStore(self.types, self.cel_validation)
        self.store.reactors.append(react)
        self.store.admission.append(pod_security)
        crd_type = self.store.types["apiextensions.k8s.io/customresourcedefinitions"]
        for crd in self.crds:
            self.store.create(crd_type, "", crd)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _stop(self) -> None:
        """Close the server, then end the watch streams still waiting for changes."""
        if self._runner is not None:
            await self._runner.cleanup()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def drop_watches(self) -> None:
        """Cut every open watch connection, as an apiserver restart or a lost connection
        does: clients must watch again from the last resourceVersion they saw."""
        def cut() -> None:
            for task in self._watches:
                task.cancel()
        self._loop.call_soon_threadsafe(cut)

    def call(self, fn: Callable[[ObjectStore], T]) -> T:
        async def run() -> T:
            assert self.store is not None
            return fn(self.store)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def write_kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "emulator"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator",
                                                          "user": "tester"}}],
        }
        path.write_text(yaml.safe_dump(config))
        return path

    # -- HTTP ----------------------------------------------------------------------------

    def _discovery(self, parts: list[str]) -> dict[str, Any] | None:
        if parts == ["version"]:
            return {"major": "1", "minor": "30", "gitVersion": "v1.30.0-emulator"}
        if parts == ["api"]:
            return {"kind": "APIVersions", "versions": ["v1"]}
        if parts == ["apis"]:
            groups = sorted({(t.group, t.version) for t in self.types if t.group})
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
                 "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v}}
                for g, v in groups]}
        group_version = ("", parts[1]) if parts[0] == "api" and len(parts) == 2 else (
            (parts[1], parts[2]) if parts[0] == "apis" and len(parts) == 3 else None)
        if group_version is None:
            return None
        resources = []
        for t in self.types:
            if (t.group, t.version) != group_version:
                continue
            verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
            resources.append({"name": t.plural, "singularName": t.kind.lower(),
                              "namespaced": t.namespaced, "kind": t.kind, "verbs": verbs,
                              "shortNames": list(t.short_names)})
            resources += [{"name": f"{t.plural}/{s}", "singularName": "", "namespaced":
                           t.namespaced, "kind": t.kind, "verbs": ["get", "patch", "update"]}
                          for s in t.subresources]
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": "/".join(p for p in group_version if p), "resources": resources}

    def _route(self, parts: list[str]) -> tuple[ResourceType, str, str, str]:
        """(type, namespace, name, subresource) of a resource path."""
        if parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        else:
            group, version, rest = parts[1], parts[2], parts[3:]
        namespace = ""
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        rt = next((t for t in self.types if (t.group, t.version, t.plural) ==
                   (group, version, rest[0])), None)
        if rt is None:
            raise ApiError(404, "NotFound", f"the server could not find {'/'.join(parts)}")
        return rt, namespace, rest[1] if len(rest) > 1 else "", rest[2] if len(rest) > 2 else ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        parts = [p for p in request.path.split("/") if p]
        try:
            found = self._discovery(parts) if parts else None
            if found is not None:
                return web.json_response(found)
            if not parts or parts[0] not in ("api", "apis"):
                raise ApiError(404, "NotFound", request.path)
            rt, namespace, name, sub = self._route(parts)
            if request.method == "GET" and not name and request.query.get("watch") in (
                    "true", "1"):
                return await self._watch(request, rt, namespace or None)
            status = 201 if request.method == "POST" else 200  # what clients expect
            return web.json_response(await self._crud(request, rt, namespace, name, sub),
                                     status=status)
        except ApiError as e:
            return web.json_response(e.status(), status=e.code)

    async def _crud(self, request: web.Request, rt: ResourceType, namespace: str, name: str,
                    sub: str) -> dict[str, Any]:
        store = self.store
        assert store is not None
        method, query = request.method, request.query
        if method == "GET" and name:
            return store.get(rt, namespace, name)
        if method == "GET":
            items = store.list(rt, namespace or None, query.get("labelSelector", ""))
            return {"apiVersion": rt.api_version, "kind": f"{rt.kind}List", "items": items,
                    "metadata": {"resourceVersion": str(store.rv)}}
        if method == "POST":
            return store.create(rt, namespace, await request.json(),
                                dry_run=query.get("dryRun") == "All")
        if method == "PUT":
            return store.update(rt, namespace, name, await request.json(), sub)
        if method == "PATCH":
            return store.patch(rt, namespace, name, request.content_type,
                               json.loads(await request.text()), sub)
        if method == "DELETE":  # pods answer with the pod (graceful deletion), others a Status
            gone = store.delete(rt, namespace, name)
            return gone if rt.kind == "Pod" else {
                "kind": "Status", "apiVersion": "v1", "status": "Success",
                "details": {"name": name, "kind": rt.plural, "uid": gone["metadata"]["uid"]}}
        raise ApiError(405, "MethodNotAllowed", method)

    async def _watch(self, request: web.Request, rt: ResourceType,
                     namespace: str | None) -> web.StreamResponse:
        """Stream events after `resourceVersion` until `timeoutSeconds` (default 300 s); with no
        resourceVersion, first an ADDED event per existing object."""
        store = self.store
        assert store is not None
        selector = request.query.get("labelSelector", "")
        since = int(request.query.get("resourceVersion") or 0)
        deadline = asyncio.get_running_loop().time() + float(
            request.query.get("timeoutSeconds", 300))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        task = asyncio.current_task()
        assert task is not None
        self._watches.add(task)
        try:
            return await self._stream(response, rt, namespace, selector, since, deadline)
        finally:
            self._watches.discard(task)

    async def _stream(self, response: web.StreamResponse, rt: ResourceType,
                      namespace: str | None, selector: str, since: int,
                      deadline: float) -> web.StreamResponse:
        store = self.store
        assert store is not None
        pending = [] if since else [(0, "ADDED", o) for o in store.list(rt, namespace, selector)]
        since = since or store.rv
        try:
            while True:
                pending += store.events_after(since, rt, namespace, selector)
                for rv, kind, obj in pending:
                    since = max(since, rv)
                    await response.write(json.dumps({"type": kind, "object": obj}).encode()
                                         + b"\n")
                pending = []
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                try:
                    await store.wait_for_change(left)
                except TimeoutError:
                    break
        except ConnectionResetError:
            return response
        await response.write_eof()
        return response
