"""The TandemService spec as typed, frozen values: what the builders and the placement read.

The CRD (charts/tandem/crds/tandemservices.tandem.dev.yaml) is the single source of defaults:
the apiserver fills them in before the operator sees an object, so `parse_spec` indexes the
fields it needs instead of repeating the defaults here. A missing field therefore means the
CRD was not installed from the chart, and says so. One exception: `shutdownGraceSeconds`
has no CRD default; a spec without it gets the services' own (tandem.shutdown), defined once.

The CRD's CEL rules are another matter: an apiserver with CEL validation off drops them
silently, so `parse_spec` repeats every one (tests/test_crd_cel.py holds one violating object
per rule and checks that both refuse it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.utils import parse_quantity

from tandem.shutdown import DEFAULT_GRACE_S

GROUP = "tandem.dev"
VERSION = "v1alpha1"
PLURAL = "tandemservices"
KIND = "TandemService"
# The pods' metrics and health ports (manifests.py), which scheduler.port must avoid.
RESERVED_PORTS = (9400, 9401, 50061)
# The pods' own mount points (manifests.py, containers.py), which model.path must avoid: a
# second volume there makes the pod invalid (mount paths are unique per container).
RESERVED_MOUNTS = ("/tmp", "/dev/shm", "/var/run/tandem", "/etc/tandem/tls",
                   "/etc/tandem/client-ca")
MAX_CELLS = 64  # the CRD's maximum of spec.cells
ROUTER_ALIAS = "router"  # routing.mode of the removed router: parsed as standalone
# A StatefulSet's pods carry the label controller-revision-hash=<statefulset>-<hash of up to 10
# characters>, and label values hold at most 63, so a StatefulSet name holds at most 52. The
# longest the operator builds is the scheduler of the last cell, <name>-63-scheduler: 39.
MAX_STATEFULSET_NAME = 52
MAX_NAME_LENGTH = MAX_STATEFULSET_NAME - len(f"-{MAX_CELLS - 1}-scheduler")
# The name is also the Service's, and Service names are DNS-1035 labels.
NAME_PATTERN = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


class SpecError(ValueError):
    """The spec cannot be served as written (a PermanentError for the handlers)."""


def quantity_bytes(value: int | str) -> int:
    """Bytes of a Kubernetes quantity ("4Gi", "512M", 1024), rounded up to a whole byte."""
    return math.ceil(parse_quantity(value))


@dataclass(frozen=True)
class Resources:
    """Container requests and limits, raw quantities as written in the spec."""

    requests: Mapping[str, str]
    limits: Mapping[str, str]


@dataclass(frozen=True)
class ModelSpec:
    """What the scheduler and every worker load, and from which volume.

    The scheduler reads the tokenizer, chat template and image processor files and the
    workers config.json and the weights, so both see the directory at the same `path`
    (TANDEM_MODEL). At most one of `claim_name` and `host_path` is set (a CEL rule).
    """

    name: str  # built-in preset, used when `path` is ""
    path: str  # the directory inside the pods ("" = the preset)
    claim_name: str  # PersistentVolumeClaim mounted read-only at `path` ("" = none)
    sub_path: str  # the claim's directory mounted there ("" = its root)
    host_path: str  # the node's directory mounted read-only at `path` ("" = none)
    served_names: tuple[str, ...]  # TANDEM_SERVED_MODEL_NAME (() = `setting` is the name)

    @property
    def setting(self) -> str:
        """TANDEM_MODEL of the scheduler and the workers."""
        return self.path or self.name

    @property
    def mounted(self) -> bool:
        return bool(self.claim_name or self.host_path)


@dataclass(frozen=True)
class SchedulerSpec:
    image: str
    port: int
    resources: Resources
    env: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class HttpSpec:
    """The OpenAI-compatible HTTP port of the schedulers and the Service."""

    enabled: bool
    port: int


@dataclass(frozen=True)
class WorkerSpec:
    image: str
    workers_per_cell: int
    tensor_parallel_size: int
    device: str
    gpu_count: int
    gpu_resource: str
    resources: Resources
    env: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class AutoSize:
    """Bounds within which the operator sizes each cell's cache from its reuse curve."""

    min: int  # bytes
    max: int


@dataclass(frozen=True)
class FeatureCacheSpec:
    type: str  # shm | lru | none
    size: int  # requested bytes (0 = off); under autoSize, the size a new cell starts with
    max_object_size: int
    max_node_memory_percent: int
    host_root: str
    cleanup_on_start: bool
    auto_size: AutoSize | None = None  # None: the size is the user's


@dataclass(frozen=True)
class PlacementSpec:
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    affinity: Mapping[str, Any]
    max_cells_per_node: int


@dataclass(frozen=True)
class Workload:
    """A Deployment of the routing: its pods and their requests and limits."""

    replicas: int
    resources: Resources


@dataclass(frozen=True)
class RoutingSpec:
    """How clients reach the cells (docs/routing.md): `gateway` (InferencePools and `tandem
    epp` for the cluster's gateway) or `standalone` (the same endpoint picker behind an
    Envoy of the operator's). The CRD still accepts `router`, the mode of the removed
    `tandem router`, as a deprecated alias: it parses as `standalone`."""

    mode: str  # gateway | standalone
    failure_mode: str  # FailClose | FailOpen: the gateway's answer while the picker is out
    load_factor: float  # the picker's bound: a cell above this times the mean load spills
    epp: Workload
    envoy: Workload
    envoy_image: str


@dataclass(frozen=True)
class TlsSpec:
    """Secrets for TLS on the public port ("" = none); a client CA needs the certificate."""

    secret_name: str
    client_ca_secret_name: str

    @property
    def enabled(self) -> bool:
        return bool(self.secret_name)


@dataclass(frozen=True)
class TracingSpec:
    endpoint: str
    sampler: str
    ratio: str


@dataclass(frozen=True)
class TandemSpec:
    """One TandemService: its identity plus the defaulted spec.

    `cache_bytes_requested` is what the cache would get on an unbounded node; placement caps
    it per node (see placement.py).
    """

    name: str
    namespace: str
    model: ModelSpec
    cells: int
    pull_policy: str
    pull_secrets: tuple[str, ...]
    scheduler: SchedulerSpec
    worker: WorkerSpec
    cache: FeatureCacheSpec
    prefix_caching: bool
    block_size: int
    shm_size: int  # /dev/shm emptyDir of the workers, bytes (0 = none)
    placement: PlacementSpec
    startup_failure_threshold: int
    run_as_user: int
    run_as_group: int
    tracing: TracingSpec
    routing: RoutingSpec
    tls: TlsSpec
    http: HttpSpec
    shutdown_grace: float  # seconds running streams may finish on SIGTERM
    # What the spec asks in a deprecated way (the router's fields): one event each.
    deprecations: tuple[str, ...] = ()

    @property
    def cache_bytes_requested(self) -> int:
        return 0 if self.cache.type == "none" else self.cache.size

    @property
    def picked(self) -> bool:
        """Whether `tandem epp` picks the cells: always for the cluster's gateway (its
        routes name the pools, whatever their size); standalone only with more than one
        cell to choose from (one cell needs no Envoy in front of it)."""
        return self.routing.mode == "gateway" or self.cells > 1

    @property
    def front(self) -> str:
        """The component clients reach through the Service, once it is available:
        standalone routing's Envoy, or the schedulers themselves."""
        return "envoy" if self.routing.mode == "standalone" and self.picked else "scheduler"


def default_worker_image(image: Mapping[str, Any], device: str, gpu_count: int) -> str:
    """`<repository>:<tag>`, with `-cuda` on the tag for workers that will run on CUDA.

    A worker runs on CUDA when its device says cuda, or says auto and it requests GPUs; the
    CUDA build of torch lives in the `-cuda` image only, the plain image stays small.
    """
    cuda = device.startswith("cuda") or (device == "auto" and gpu_count > 0)
    return f"{image['repository']}:{image['tag']}{'-cuda' if cuda else ''}"


def _resources(raw: Mapping[str, Any]) -> Resources:
    return Resources(
        requests={k: str(v) for k, v in (raw.get("requests") or {}).items()},
        limits={k: str(v) for k, v in (raw.get("limits") or {}).items()},
    )


def _env(raw: list[Mapping[str, str]] | None) -> tuple[tuple[str, str], ...]:
    return tuple((e["name"], e["value"]) for e in raw or ())


def _worker(image: Mapping[str, Any], wrk: Mapping[str, Any]) -> WorkerSpec:
    gpu = wrk["gpu"]
    return WorkerSpec(
        image=wrk.get("image") or default_worker_image(image, wrk["device"], gpu["count"]),
        workers_per_cell=wrk["workersPerCell"],
        tensor_parallel_size=wrk["tensorParallelSize"],
        device=wrk["device"],
        gpu_count=gpu["count"],
        gpu_resource=gpu["resourceName"],
        resources=_resources(wrk["resources"]),
        env=_env(wrk.get("env")),
    )


def _workload(raw: Mapping[str, Any]) -> Workload:
    return Workload(raw["replicas"], _resources(raw["resources"]))


def _routing(raw: Mapping[str, Any]) -> RoutingSpec:
    return RoutingSpec(mode="standalone" if raw["mode"] == ROUTER_ALIAS else raw["mode"],
                       failure_mode=raw["failureMode"], load_factor=float(raw["loadFactor"]),
                       epp=_workload(raw["epp"]), envoy=_workload(raw["envoy"]),
                       envoy_image=raw["envoy"]["image"])


def _deprecations(s: Mapping[str, Any]) -> tuple[str, ...]:
    """What a spec written for the removed router asks: it still applies (the CRD keeps
    the fields), and each gets a warning saying what to write instead."""
    out = []
    if s["routing"]["mode"] == ROUTER_ALIAS:
        out.append("routing.mode router is deprecated: tandem router was removed, and this "
                   "service runs as routing.mode standalone (Envoy and the endpoint picker "
                   "tandem epp); set routing.mode standalone (docs/routing.md)")
    if s.get("router"):
        out.append("spec.router is ignored since tandem router was removed: set "
                   "routing.loadFactor, routing.envoy and routing.epp instead, and remove it "
                   "(docs/routing.md)")
    return tuple(out)


def _cache(fc: Mapping[str, Any]) -> FeatureCacheSpec:
    auto = fc.get("autoSize")
    return FeatureCacheSpec(
        type=fc["type"],
        size=quantity_bytes(fc["size"]),
        max_object_size=quantity_bytes(fc["maxObjectSize"]),
        max_node_memory_percent=fc["maxNodeMemoryPercent"],
        host_root=fc["hostPath"]["root"].rstrip("/") or "/",
        cleanup_on_start=fc["cleanupOnStart"],
        auto_size=AutoSize(quantity_bytes(auto["min"]), quantity_bytes(auto["max"]))
        if auto is not None else None,
    )


def _parse(name: str, namespace: str, s: Mapping[str, Any]) -> TandemSpec:
    image, sch, place, model = s["image"], s["scheduler"], s["placement"], s["model"]
    shm, tracing = s["sharedMemory"], s["tracing"]
    return TandemSpec(
        name=name,
        namespace=namespace,
        model=ModelSpec(name=model["name"], path=model.get("path", ""),
                        claim_name=model.get("claimName", ""),
                        sub_path=model.get("subPath", ""), host_path=model.get("hostPath", ""),
                        served_names=tuple(model.get("servedNames", ()))),
        cells=s["cells"],
        pull_policy=image["pullPolicy"],
        pull_secrets=tuple(image.get("pullSecrets") or ()),
        scheduler=SchedulerSpec(
            image=sch.get("image") or f"{image['repository']}:{image['tag']}",
            port=sch["port"],
            resources=_resources(sch["resources"]),
            env=_env(sch.get("env")),
        ),
        worker=_worker(image, s["worker"]),
        cache=_cache(s["featureCache"]),
        prefix_caching=s["prefixCache"]["enabled"],
        block_size=s["prefixCache"]["blockSize"],
        shm_size=0 if shm["disabled"] else quantity_bytes(shm["size"]),
        placement=PlacementSpec(
            node_selector=dict(place.get("nodeSelector") or {}),
            tolerations=tuple(place.get("tolerations") or ()),
            affinity=dict(place.get("affinity") or {}),
            max_cells_per_node=place["maxCellsPerNode"],
        ),
        startup_failure_threshold=s["probes"]["startupFailureThreshold"],
        run_as_user=s["securityContext"]["runAsUser"],
        run_as_group=s["securityContext"]["runAsGroup"],
        tracing=TracingSpec(tracing["endpoint"], tracing["sampler"], tracing["ratio"]),
        routing=_routing(s["routing"]),
        tls=TlsSpec(s["tls"].get("secretName", ""), s["tls"].get("clientCASecretName", "")),
        http=HttpSpec(s["http"]["enabled"], s["http"]["port"]),
        shutdown_grace=float(s.get("shutdownGraceSeconds", DEFAULT_GRACE_S)),
        deprecations=_deprecations(s),
    )


def _check_name(name: str) -> None:
    """The CRD's two rules on metadata.name."""
    if len(name) > MAX_NAME_LENGTH:
        raise SpecError(
            f"the name {name!r} has {len(name)} characters; at most {MAX_NAME_LENGTH} fit: the "
            f"StatefulSets <name>-<cell>-scheduler are limited to {MAX_STATEFULSET_NAME} "
            "(their pods' controller-revision-hash label). Recreate it with a shorter name")
    if not NAME_PATTERN.fullmatch(name):
        raise SpecError(
            f"the name {name!r} is not a DNS label starting with a letter (lowercase letters, "
            "digits and '-'); it names the Services, which need one. Recreate it renamed")


def _has_backstep(path: str) -> bool:
    """A `..` element, which Kubernetes refuses in a subPath and in a hostPath."""
    return ".." in path.split("/")


def _check_model(m: ModelSpec) -> None:
    """The CRD's CEL rules on spec.model and its fields, in the CRD's order."""
    if m.claim_name and not m.path:
        raise SpecError(f"model.claimName {m.claim_name!r} needs model.path: the directory "
                        "the claim is mounted at, where the pods load the model from")
    if m.host_path and not m.path:
        raise SpecError(f"model.hostPath {m.host_path!r} needs model.path: the directory the "
                        "node's directory is mounted at, where the pods load the model from")
    if m.claim_name and m.host_path:
        raise SpecError(f"model.claimName {m.claim_name!r} and model.hostPath {m.host_path!r} "
                        "exclude each other: the model comes from one volume; keep one")
    if m.sub_path and not m.claim_name:
        raise SpecError(f"model.subPath {m.sub_path!r} needs model.claimName: it is a directory "
                        "inside that claim (a node's directory goes whole into model.hostPath)")
    if m.path and "/" + m.path.strip("/") in ("/", *RESERVED_MOUNTS):
        raise SpecError(f"model.path {m.path!r} is taken: /, {', '.join(RESERVED_MOUNTS)} are "
                        "the pods' own mounts; choose another directory, e.g. /models/<name>")
    if m.sub_path.startswith("/") or _has_backstep(m.sub_path):
        raise SpecError(f"model.subPath {m.sub_path!r} must be a relative path without '..' "
                        "elements: a directory inside the claim")
    if _has_backstep(m.host_path):
        raise SpecError(f"model.hostPath {m.host_path!r} must not contain a '..' element "
                        "(Kubernetes refuses it): write the directory out")


def _check_rules(s: TandemSpec) -> None:
    """The CRD's CEL rules on the spec, one `if` each, in the CRD's order."""
    _check_model(s.model)
    if s.scheduler.port in RESERVED_PORTS:
        raise SpecError(f"scheduler.port {s.scheduler.port} is taken: 9400, 9401 and 50061 are "
                        "the pods' metrics and health ports; choose another (default 50051)")
    if s.http.port in (*RESERVED_PORTS, s.scheduler.port):
        raise SpecError(f"http.port {s.http.port} is taken: scheduler.port, 9400, 9401 and "
                        "50061 are the pods' gRPC, metrics and health ports; choose another "
                        "(default 8000)")
    if s.worker.device.startswith("cuda") and s.worker.gpu_count == 0:
        raise SpecError(f"worker.device {s.worker.device} needs worker.gpu.count >= 1 (it is "
                        "0): request GPUs, or set the device to cpu or auto")
    if s.worker.workers_per_cell % s.worker.tensor_parallel_size:
        raise SpecError(f"worker.workersPerCell ({s.worker.workers_per_cell}) must be a "
                        "multiple of worker.tensorParallelSize "
                        f"({s.worker.tensor_parallel_size}): each group of that many workers "
                        "shares one copy of the model")
    if s.tls.client_ca_secret_name and not s.tls.enabled:
        raise SpecError("tls.clientCASecretName needs tls.secretName: mutual TLS is TLS plus "
                        "client certificates, so name the server certificate's Secret too")
    _check_auto_size(s.cache)


def _check_auto_size(c: FeatureCacheSpec) -> None:
    """The CRD's rule on featureCache.autoSize, and min <= max, which CEL cannot compare
    (quantities are strings to it without the Kubernetes quantity library)."""
    if c.auto_size is None:
        return
    if c.type == "none":
        raise SpecError("featureCache.autoSize needs a cache to size: featureCache.type is "
                        "none; set it to shm or lru, or remove autoSize")
    if c.auto_size.min <= 0:
        raise SpecError("featureCache.autoSize.min must be above 0: the operator never turns "
                        "the cache off (set featureCache.type none for that)")
    if c.auto_size.min > c.auto_size.max:
        raise SpecError(f"featureCache.autoSize.min ({c.auto_size.min} bytes) is above "
                        f"autoSize.max ({c.auto_size.max} bytes); swap them")


def parse_spec(name: str, namespace: str, spec: Mapping[str, Any],
               check_rules: bool = True) -> TandemSpec:
    """Parse a defaulted spec and reject what this operator version cannot serve, every CEL
    rule of the CRD included (unless `check_rules` is False: removing what an older operator
    placed needs only where things are).

    Raises SpecError with a message meant for the `Ready` condition.
    """
    if check_rules:
        _check_name(name)
    try:
        parsed = _parse(name, namespace, spec)
    except KeyError as e:
        raise SpecError(
            f"spec field {e.args[0]!r} is missing: the CRD's defaults were not applied "
            "(install the CRD from charts/tandem/crds)"
        ) from e
    except ValueError as e:  # a quantity the CRD pattern let through but Kubernetes rejects
        raise SpecError(f"invalid quantity in the spec: {e}") from e
    if check_rules:
        _check_rules(parsed)
    return parsed

