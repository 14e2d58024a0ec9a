"""The observability parts without a cell: the trace-file format, its reader and view,
trace-context helpers, the off switch, and the metrics endpoint."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tandem import tracing
from tandem.errors import ErrorMappingInterceptor
from tandem.metrics import MetricsEndpoint, RequestLatency, SnapshotCollector
from tandem_cli.traces_view import read_spans, render


def _provider(path: Path, service: str) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(tracing.OtlpJsonFileExporter(path)))
    return provider


def _write_request(path: Path) -> tuple[str, str]:
    """A scheduler request span with one image, and a worker step linking to it, written
    by two providers (two processes' worth) to one file. Returns (trace id, span id)."""
    scheduler = _provider(path, "tandem-scheduler").get_tracer("t")
    worker_provider = _provider(path, "tandem-worker")
    with (scheduler.start_as_current_span("/tandem.v1.Generation/Generate"),
          scheduler.start_as_current_span("generate_content tiny") as request):
        request.set_attributes({
            "gen_ai.response.id": "r1", "gen_ai.usage.input_tokens": 83,
            "gen_ai.usage.cache_read.input_tokens": 80, "tandem.mm.items": 1,
            "tandem.mm.cache_hits": 1, "tandem.mm.encoder_runs": 0,
            "tandem.prefix_cache.hit_ratio": 80 / 83, "gen_ai.usage.output_tokens": 4,
            "gen_ai.response.finish_reasons": ["length"]})
        request.add_event("prefix_cache_lookup", {"hit_blocks": 5, "total_blocks": 5})
        with scheduler.start_as_current_span("tandem.mm.process") as image:
            image.set_attributes({"tandem.mm.cache.result": "hit",
                                  "tandem.mm.hash": "0123456789abcdef",
                                  "tandem.mm.transport": "shm", "tandem.mm.num_tokens": 64,
                                  "tandem.mm.encoder.result": "skipped",
                                  "tandem.mm.cached_tokens": 64,
                                  "tandem.shm.address": 4096, "tandem.shm.monotonic_id": 7,
                                  "tandem.shm.object_bytes": 2048})
        link = tracing.link_to(tracing.traceparent(request))
    assert link is not None
    step = worker_provider.get_tracer("t").start_span(
        "tandem.worker.step", links=[link],
        attributes={"tandem.worker.rank": 0, "tandem.shm.resolved": 0, "tandem.shm.acked": 1,
                    "tandem.encoder.runs": 0})
    step.end()
    ctx = request.get_span_context()
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def test_trace_file_is_otlp_json_lines_with_hex_ids(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    trace_id, span_id = _write_request(path)
    lines = path.read_text().splitlines()
    assert len(lines) == 4  # one TracesData per export, whole lines from both "processes"
    first = json.loads(lines[0])["resourceSpans"][0]
    assert first["scopeSpans"][0]["spans"][0]["traceId"] == trace_id
    spans = read_spans(path)
    [step] = [s for s in spans if s.name == "tandem.worker.step"]
    assert step.links == [(trace_id, span_id)] and step.service == "tandem-worker"
    [image] = [s for s in spans if s.name == "tandem.mm.process"]
    assert image.parent_id == span_id and image.attributes["tandem.shm.address"] == 4096
    [request] = [s for s in spans if s.span_id == span_id]
    assert request.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert request.attributes["tandem.prefix_cache.hit_ratio"] == pytest.approx(80 / 83)


def test_view_draws_the_request_tree(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    _write_request(path)
    with path.open("a") as f:
        f.write('{"resourceSpans": [')  # a line cut short by a crash is skipped
    lines = render(read_spans(path), 5).splitlines()
    assert lines[0].startswith("request r1  trace ")
    assert lines[1].startswith("/tandem.v1.Generation/Generate")
    assert "generate_content tiny" in lines[2]
    assert "prompt 83 cached 80 (96%) | images 1 mm hits 1 encoder 0 | out 4 length" in lines[2]
    assert "tandem.mm.process" in lines[3]
    assert lines[3].split("ms  ")[1].split() == [
        "0123456789abcdef", "cache", "hit", "shm", "encoder", "skipped", "prefix", "64/64",
        "tokens", "@4096", "id", "7", "2.0", "KiB"]
    assert "tandem.worker.step x1 (linked)" in lines[4] and "rank 0" in lines[4]
    assert "acked 1" in lines[4]
    assert "prefix_cache_lookup" in lines[5] and "5/5 blocks" in lines[5]
    assert render([], 5) == "no requests in the trace file yet"


def test_trace_context_helpers() -> None:
    provider = TracerProvider()
    span = provider.get_tracer("t").start_span("x")
    header = tracing.traceparent(span)
    link = tracing.link_to(header, {"k": 1})
    assert link is not None and link.context.span_id == span.get_span_context().span_id
    assert tracing.link_to("garbage") is None
    assert tracing.traceparent(trace.INVALID_SPAN) == ""
    parent = trace.get_current_span(tracing.context_from_metadata([("traceparent", header)]))
    assert parent.get_span_context().trace_id == span.get_span_context().trace_id


def test_server_span_parents_handler_spans_and_survives_cancel(
        caplog: pytest.LogCaptureFixture) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        tracer.start_span("inside").end()  # parented by the server span, as the servicer's
        for _ in range(10_000):
            yield bytes(1 << 16)  # flow control stalls the send: cancelled outside the handler

    async def run() -> None:
        interceptors = [tracing.ServerSpanInterceptor(["t.S"], tracer), ErrorMappingInterceptor()]
        server = grpc.aio.server(interceptors=interceptors)  # the scheduler's chain
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "t.S", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/t.S/Stream")(b"", metadata=(("traceparent", caller),))
            await call.read()
            call.cancel()  # the handler's generator is closed from another context
            for _ in range(200):
                if len(exporter.get_finished_spans()) == 2:
                    break
                await asyncio.sleep(0.01)
        await server.stop(0)

    asyncio.run(run())
    server_span, inside = sorted(exporter.get_finished_spans(), key=lambda s: s.name)
    assert server_span.name == "/t.S/Stream" and server_span.kind is trace.SpanKind.SERVER
    _, trace_id, span_id, _ = caller.split("-")
    assert f"{server_span.context.trace_id:032x}" == trace_id
    assert server_span.parent is not None and f"{server_span.parent.span_id:016x}" == span_id
    assert inside.parent is not None and inside.parent.span_id == server_span.context.span_id
    assert server_span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert server_span.status.status_code is trace.StatusCode.ERROR
    assert "Failed to detach context" not in caplog.text


def test_tracing_stays_off_without_an_exporter(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 tracing.TRACE_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    assert tracing.setup("tandem-test") is False
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.setup("tandem-test", trace_file=str(tmp_path / "t.jsonl")) is False
    assert not tracing.enabled() and not (tmp_path / "t.jsonl").exists()


def test_metrics_endpoint_serves_snapshot_and_histograms() -> None:
    values = {"tandem_prompt_tokens_total": 0.0, "tandem_shm_used_bytes": 10.0}
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: values))
    latency = RequestLatency(registry)

    async def run() -> tuple[str, int]:
        endpoint = await MetricsEndpoint.start(registry, 0, "127.0.0.1")
        url = f"http://127.0.0.1:{endpoint.port}"
        try:
            values["tandem_prompt_tokens_total"] = 42.0  # read at scrape time
            latency.observe(0.5, 2.5, 5)  # TPOT (2.5 - 0.5) / 4
            latency.observe(None, 1.0, 0)  # no token: duration only
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url + "/metrics").read())
            with pytest.raises(urllib.error.HTTPError) as missing:
                await asyncio.to_thread(urllib.request.urlopen, url + "/other")
            return text.decode(), missing.value.code
        finally:
            await endpoint.close()

    text, missing_code = asyncio.run(run())
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
               if not s.labels}
    assert samples["tandem_prompt_tokens_total"] == 42.0
    assert samples["tandem_shm_used_bytes"] == 10.0
    assert samples["tandem_request_duration_seconds_count"] == 2
    assert samples["tandem_time_to_first_token_seconds_count"] == 1
    assert samples["tandem_time_per_output_token_seconds_sum"] == pytest.approx(0.5)
    assert missing_code == 404
