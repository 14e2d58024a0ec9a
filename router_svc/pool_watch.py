"""``tandem epp --pool``: the picker's cells from an InferencePool and the pods it selects.

The Gateway API Inference Extension's InferencePool (``inference.networking.k8s.io/v1``)
names its model-server pods by a label selector and the port traffic goes to. The operator
renders two pools over the same schedulers (tandem_operator.gateway): ``<name>-grpc``
(h2c, ``tandem.v1``) and ``<name>-http`` (the OpenAI API). ``--pool`` names the gRPC one:
its selector picks the pods, its first target port is where the picker checks each cell and
sends gRPC requests. ``--http-pool`` names the HTTP one, for the port of HTTP requests
(without it, ``--http-port``). NOTE: two pools rather than one pool plus the pods' named
container ports, because the pools are what the gateway itself routes by: the picker then
sends a request to exactly the port the gateway's pool declares.

A cell is a pod that is Ready, not terminating and has an IP. Its name is the pod's own DNS
name when it has one (``hostname.subdomain.namespace.svc``, as a StatefulSet's pods do, and
as the cells' TLS certificates name them), else its IP; requests go to the pod IP.

Both are followed as controllers do: list, then watch from the list's resourceVersion; a
watch that ends is resumed from the last version seen, one the server expired (410) starts
over with a list, and an error (API server unreachable, RBAC refusal) is logged and retried
with exponential backoff. Until a fresh list of the pods arrives the picker keeps the cells
it had (none at the start, when ``tandem epp`` is not ready yet); a missing pool is logged
and keeps them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from router_svc.epp import CellEndpoint

log = logging.getLogger(__name__)

Obj = dict[str, Any]
POOLS_PATH = "/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools"
PODS_PATH = "/api/v1/namespaces/{namespace}/pods"
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_S = 300  # the server ends each watch after this long; it is then resumed
CONNECT_TIMEOUT_S = 10.0
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 30.0


@dataclass(frozen=True)
class PoolSource:
    """``--pool``, ``--http-pool``, ``--pool-namespace`` (default: the pod's own, from its
    service account, else the kubeconfig context's) and ``--kubeconfig`` (default: the
    in-cluster service account, else $KUBECONFIG or ~/.kube/config)."""

    pool: str
    http_pool: str = ""
    namespace: str = ""
    kubeconfig: str = ""


class KubeError(Exception):
    """The API server answered with an error status (or an ERROR watch event)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}")
        self.status = status


def connection(source: PoolSource) -> tuple[Any, str]:
    """(a ``kubernetes.client.Configuration``, the namespace): credentials and server as
    the official client would find them. ``kubernetes.config.ConfigException`` when there
    are none."""
    import kubernetes  # a second or so to import: only for --pool

    config = kubernetes.client.Configuration()
    namespace = source.namespace
    if not source.kubeconfig:
        with contextlib.suppress(kubernetes.config.ConfigException):
            kubernetes.config.load_incluster_config(client_configuration=config)
            return config, namespace or NAMESPACE_FILE.read_text().strip()
    # KUBECONFIG is read now: the client's own default was fixed when it was imported.
    path = source.kubeconfig or os.environ.get("KUBECONFIG") or None
    kubernetes.config.load_kube_config(config_file=path, client_configuration=config)
    _, context = kubernetes.config.list_kube_config_contexts(path)
    return config, namespace or context["context"].get("namespace") or "default"


class KubeClient:
    """The two calls the watch makes (list and watch), over httpx, authenticated as the
    official client's configuration says (the token is read again at every call: in-cluster
    tokens rotate)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        context = ssl.create_default_context(cafile=config.ssl_ca_cert or None)
        if not config.verify_ssl:
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        if config.cert_file:
            context.load_cert_chain(config.cert_file, config.key_file)
        self._http = httpx.AsyncClient(base_url=config.host, verify=context,
                                       timeout=httpx.Timeout(CONNECT_TIMEOUT_S))

    def _headers(self) -> dict[str, str]:
        token = self.config.auth_settings().get("BearerToken", {}).get("value")
        return {"Authorization": token} if token else {}

    async def list(self, path: str, params: Mapping[str, str]) -> Obj:
        reply = await self._http.get(path, params=params, headers=self._headers())
        if reply.status_code != 200:
            raise _error(reply.status_code, reply.content)
        body: Obj = reply.json()
        return body

    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[Obj]:
        """The events of one watch, until the server ends it."""
        query = {**params, "watch": "true", "timeoutSeconds": str(WATCH_S),
                 "allowWatchBookmarks": "true"}
        timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=WATCH_S + CONNECT_TIMEOUT_S)
        async with self._http.stream("GET", path, params=query, headers=self._headers(),
                                     timeout=timeout) as reply:
            if reply.status_code != 200:
                raise _error(reply.status_code, await reply.aread())
            async for line in reply.aiter_lines():
                if line.strip():
                    yield json.loads(line)

    async def close(self) -> None:
        await self._http.aclose()


def _error(status: int, body: bytes) -> KubeError:
    try:
        message = str(json.loads(body).get("message", ""))
    except ValueError:
        message = body[:200].decode(errors="replace")
    return KubeError(status, message)


Listed = Callable[[list[Obj]], Awaitable[None]]
Changed = Callable[[str, Obj], Awaitable[None]]


async def reflect(client: KubeClient, path: str, params: Mapping[str, str], what: str,
                  listed: Listed, changed: Changed) -> None:
    """Forever: list (``listed`` gets the items), then watch from there (``changed`` gets
    each ADDED, MODIFIED or DELETED object). Errors are logged and retried with backoff."""
    version, delay = "", BACKOFF_MIN_S
    while True:
        try:
            if not version:
                body = await client.list(path, params)
                version = body["metadata"]["resourceVersion"]
                await listed(body["items"])
            async for event in client.watch(path, {**params, "resourceVersion": version}):
                kind, obj = event["type"], event["object"]
                if kind == "ERROR":
                    raise KubeError(obj.get("code", 0), obj.get("message", ""))
                version = obj["metadata"]["resourceVersion"]
                if kind != "BOOKMARK":
                    await changed(kind, obj)
                delay = BACKOFF_MIN_S
        except (httpx.HTTPError, KubeError, ValueError, KeyError) as exc:
            if isinstance(exc, KubeError) and exc.status == 410:  # expired: list again
                version = ""
                continue
            log.warning("watching %s: %s; retrying in %.1f s", what,
                        _describe(exc), delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, BACKOFF_MAX_S)


def _describe(exc: Exception) -> str:
    if isinstance(exc, KubeError) and exc.status in (401, 403):
        return (f"{exc} (the picker's service account needs list and watch on pods "
                "and inferencepools: docs/operator.md)")
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return f"the API server is unreachable ({exc})"
    if isinstance(exc, httpx.HTTPError):
        return f"the connection to the API server broke ({type(exc).__name__}: {exc})"
    return str(exc)


def selector(pool: Obj) -> str:
    """The pool's selector as a label selector query (v1 pools select by matchLabels)."""
    labels = pool["spec"]["selector"]["matchLabels"]
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def target_port(pool: Obj) -> int:
    return int(pool["spec"]["targetPorts"][0]["number"])


def pod_cell(pod: Obj, grpc_port: int, http_port: int) -> CellEndpoint | None:
    """The cell a pod is, or None while it is not Ready, has no IP, or is terminating."""
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    ip = status.get("podIP")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or ())
    if not ip or not ready or meta.get("deletionTimestamp"):
        return None
    host = ip
    if spec.get("hostname") and spec.get("subdomain"):
        host = f"{spec['hostname']}.{spec['subdomain']}.{meta['namespace']}.svc"
    return CellEndpoint(host, grpc_port, http_port, ip)


class PoolWatch:
    """Follows the pools and their pods; hands each new cell set to ``publish``.

    ``pools`` and ``pods`` mirror the API server (pods: of the current selector, valid once
    ``pods_listed``); only the reflect callbacks below change them. ``publish`` runs from
    one task only, never concurrently, and only with a set that differs from the last.
    """

    def __init__(self, client: KubeClient, namespace: str, source: PoolSource,
                 default_http_port: int,
                 publish: Callable[[tuple[CellEndpoint, ...]], Awaitable[None]]) -> None:
        self.client, self.namespace, self.source = client, namespace, source
        self.default_http_port = default_http_port
        self.publish = publish
        self.pools: dict[str, Obj] = {}
        self.pods: dict[str, Obj] = {}
        self.pods_listed = False
        self.selector: str | None = None
        self.published: tuple[CellEndpoint, ...] | None = None
        self._changed = asyncio.Event()
        self._pods_task: asyncio.Task[None] | None = None

    @property
    def pool_name(self) -> str:
        return f"InferencePool {self.namespace}/{self.source.pool}"

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(reflect(
                    self.client, POOLS_PATH.format(namespace=self.namespace), {},
                    f"InferencePools in {self.namespace}", self._pools_listed,
                    self._pool_changed))
                tasks.create_task(self._publishing())
        finally:
            await self._stop_pods()

    def cells(self) -> tuple[CellEndpoint, ...]:
        grpc_pool = self.pools[self.source.pool]
        http_pool = self.pools.get(self.source.http_pool)
        http_port = target_port(http_pool) if http_pool else self.default_http_port
        found = (pod_cell(p, target_port(grpc_pool), http_port)
                 for _, p in sorted(self.pods.items()))
        # By name, once: two pods on one address (host-network pods of one node) are one
        # cell to the picker, whose balancer refuses a name twice.
        return tuple({c.name: c for c in found if c is not None}.values())

    async def _publishing(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            if not self.pods_listed or self.source.pool not in self.pools:
                continue
            cells = self.cells()
            if cells != self.published:
                await self.publish(cells)
                self.published = cells

    async def _pools_listed(self, items: list[Obj]) -> None:
        wanted = {self.source.pool, self.source.http_pool}
        self.pools = {p["metadata"]["name"]: p for p in items if p["metadata"]["name"] in wanted}
        await self._pools_now()

    async def _pool_changed(self, kind: str, pool: Obj) -> None:
        name = pool["metadata"]["name"]
        if name not in (self.source.pool, self.source.http_pool):
            return
        if kind == "DELETED":
            self.pools.pop(name, None)
        else:
            self.pools[name] = pool
        await self._pools_now()

    async def _pools_now(self) -> None:
        """Follow the pods of the gRPC pool's selector (a new one: list them again)."""
        pool = self.pools.get(self.source.pool)
        if pool is None:
            log.warning("%s not found: keeping the current %d cells", self.pool_name,
                        len(self.published or ()))
        if self.source.http_pool and self.source.http_pool not in self.pools:
            log.warning("InferencePool %s/%s not found: HTTP requests go to port %d",
                        self.namespace, self.source.http_pool, self.default_http_port)
        wanted = None if pool is None else selector(pool)
        if wanted != self.selector:
            await self._stop_pods()
            self.selector, self.pods, self.pods_listed = wanted, {}, False
            if wanted is not None:
                log.info("%s selects pods %s", self.pool_name, wanted)
                self._pods_task = asyncio.create_task(reflect(
                    self.client, PODS_PATH.format(namespace=self.namespace),
                    {"labelSelector": wanted}, f"the pods of {self.pool_name}",
                    self._pods_listed, self._pod_changed), name="pool-pods")
        self._changed.set()

    async def _stop_pods(self) -> None:
        if self._pods_task is not None:
            self._pods_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pods_task
            self._pods_task = None

    async def _pods_listed(self, items: list[Obj]) -> None:
        self.pods = {p["metadata"]["name"]: p for p in items}
        self.pods_listed = True
        self._changed.set()

    async def _pod_changed(self, kind: str, pod: Obj) -> None:
        if kind == "DELETED":
            self.pods.pop(pod["metadata"]["name"], None)
        else:
            self.pods[pod["metadata"]["name"]] = pod
        self._changed.set()
