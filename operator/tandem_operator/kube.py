"""The few Kubernetes API calls the operator makes, for the kinds it creates.

One `KubeApi` per operator (built in the startup handler, kept in kopf's memo). The official
client is synchronous, so every call runs in a worker thread and the handlers stay async:
kopf then runs all of them on one event loop, and the per-object state they share needs no
thread locks.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

_MERGE_PATCH = "application/merge-patch+json"


class InferencePoolApi:
    """The namespaced calls of the Gateway API Inference Extension's InferencePool, in the
    typed APIs' shape (`<verb>_namespaced_inference_pool`), over the custom objects API."""

    _WHERE = ("inference.networking.k8s.io", "v1")
    _PLURAL = "inferencepools"

    def __init__(self, client: kubernetes.client.ApiClient) -> None:
        self._api = kubernetes.client.CustomObjectsApi(client)

    def create_namespaced_inference_pool(self, namespace: str, body: Any, **kw: Any) -> Any:
        return self._api.create_namespaced_custom_object(*self._WHERE, namespace,
                                                         self._PLURAL, body, **kw)

    def patch_namespaced_inference_pool(self, name: str, namespace: str, body: Any,
                                        **kw: Any) -> Any:
        return self._api.patch_namespaced_custom_object(*self._WHERE, namespace,
                                                        self._PLURAL, name, body, **kw)

    def delete_namespaced_inference_pool(self, name: str, namespace: str, **kw: Any) -> Any:
        return self._api.delete_namespaced_custom_object(*self._WHERE, namespace,
                                                         self._PLURAL, name, **kw)

    def read_namespaced_inference_pool(self, name: str, namespace: str) -> Any:
        return self._api.get_namespaced_custom_object(*self._WHERE, namespace, self._PLURAL,
                                                      name)

    def list_namespaced_inference_pool(self, namespace: str, **kw: Any) -> Any:
        return self._api.list_namespaced_custom_object(*self._WHERE, namespace,
                                                       self._PLURAL, **kw)


_KINDS: dict[str, tuple[Any, str]] = {  # kind -> (API class, method suffix)
    "ConfigMap": (kubernetes.client.CoreV1Api, "namespaced_config_map"),
    "Service": (kubernetes.client.CoreV1Api, "namespaced_service"),
    "Pod": (kubernetes.client.CoreV1Api, "namespaced_pod"),
    "Secret": (kubernetes.client.CoreV1Api, "namespaced_secret"),  # read only: TLS to cells
    "ServiceAccount": (kubernetes.client.CoreV1Api, "namespaced_service_account"),
    "Role": (kubernetes.client.RbacAuthorizationV1Api, "namespaced_role"),
    "RoleBinding": (kubernetes.client.RbacAuthorizationV1Api, "namespaced_role_binding"),
    "StatefulSet": (kubernetes.client.AppsV1Api, "namespaced_stateful_set"),
    "Deployment": (kubernetes.client.AppsV1Api, "namespaced_deployment"),
    "Job": (kubernetes.client.BatchV1Api, "namespaced_job"),
    "InferencePool": (InferencePoolApi, "namespaced_inference_pool"),
}


class Rejected(Exception):
    """The apiserver refused a call (admission, quota, validation, RBAC). `str()` names the
    call, for the Event kopf posts when a handler fails with it (a raw ApiException would
    post HTTP headers); `message` is the apiserver's own words."""

    def __init__(self, status: int, message: str, call: str) -> None:
        super().__init__(f"{call} was refused ({status}): {message}")
        self.status = status
        self.message = message

    @property
    def pod_security(self) -> bool:
        return self.status == 403 and "PodSecurity" in self.message


def _message(e: ApiException) -> str:
    try:
        return str(json.loads(e.body or "{}").get("message") or e.reason)
    except ValueError:
        return str(e.reason)


def _rejected(e: ApiException, call: str) -> Rejected:
    return Rejected(e.status or 0, _message(e), call)


class KubeApi:
    """Create-or-update, delete and read for ConfigMaps, Services, Pods, StatefulSets,
    Deployments, Jobs, InferencePools, and the endpoint picker's ServiceAccount, Role and
    RoleBinding; read for Secrets."""

    def __init__(self, client: kubernetes.client.ApiClient) -> None:
        self._client = client
        self._apis = {cls: cls(client) for cls, _ in _KINDS.values()}

    @classmethod
    def from_environment(cls) -> KubeApi:
        """In-cluster service account if there is one, else the kubeconfig (KUBECONFIG)."""
        config = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
        except ConfigException:
            # KUBECONFIG is read now: the client's own default was fixed when it was imported.
            kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"),
                                               client_configuration=config)
        return cls(kubernetes.client.ApiClient(config))

    def close(self) -> None:
        self._client.close()

    def _method(self, verb: str, kind: str) -> Any:
        api_cls, suffix = _KINDS[kind]
        return getattr(self._apis[api_cls], f"{verb}_{suffix}")

    def _apply(self, obj: Mapping[str, Any], create_only: bool, dry_run: bool) -> None:
        kind, meta = obj["kind"], obj["metadata"]
        what = f"{kind} {meta['namespace']}/{meta['name']}"
        extra = {"dry_run": "All"} if dry_run else {}
        try:
            self._method("create", kind)(meta["namespace"], obj, **extra)
            return
        except ApiException as e:
            if e.status != 409 or dry_run:
                raise _rejected(e, f"{'a dry run of ' if dry_run else ''}creating {what}") from e
        if create_only:
            return
        try:  # 409: it exists; a merge patch of the whole object updates it
            self._method("patch", kind)(meta["name"], meta["namespace"], obj,
                                        _content_type=_MERGE_PATCH)
        except ApiException as e:
            raise _rejected(e, f"updating {what}") from e

    async def apply(self, obj: Mapping[str, Any], create_only: bool = False) -> None:
        """Create, or (409: it exists) merge-patch it to the built state.

        `create_only` leaves an existing object alone (Jobs: their pod template is immutable).
        """
        await asyncio.to_thread(self._apply, obj, create_only, False)

    async def dry_run_create(self, obj: Mapping[str, Any]) -> None:
        """Raise Rejected if admission (e.g. Pod Security) would refuse to create `obj`."""
        await asyncio.to_thread(self._apply, obj, True, True)

    def _delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            # The answer is not read (nothing needs it): its shape differs by kind and server
            # (a Status where the typed client expects the deleted Service), and the typed
            # client fails to deserialize what it does not expect.
            self._method("delete", kind)(name, namespace, propagation_policy="Background",
                                         _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise _rejected(e, f"deleting {kind} {namespace}/{name}") from e

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete (dependents in the background); already gone is fine."""
        await asyncio.to_thread(self._delete, kind, namespace, name)

    def _read(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj = self._method("read", kind)(name, namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise _rejected(e, f"reading {kind} {namespace}/{name}") from e
        result: dict[str, Any] = self._client.sanitize_for_serialization(obj)
        return result

    async def read(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self._read, kind, namespace, name)

    def _list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        try:
            result = self._method("list", kind)(namespace, label_selector=selector)
        except ApiException as e:
            raise _rejected(e, f"listing {kind} in {namespace} ({selector})") from e
        items: list[dict[str, Any]] = self._client.sanitize_for_serialization(result)["items"]
        return items

    async def list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        """Objects of `kind` in `namespace` matching the label selector."""
        return await asyncio.to_thread(self._list, kind, namespace, selector)
