"""OpenTelemetry tracing for every Tandem process (scheduler, worker, operator).

Tracing is off unless an OTLP endpoint or a trace file is configured. When it is off,
:func:`setup` installs nothing, :func:`enabled` is False, and instrumented code holds
``None`` instead of spans, so the hot path pays one ``is None`` test and no SDK work.

Configuration is the standard ``OTEL_*`` environment (endpoint, sampler through
``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_BSP_*`` batching, ``OTEL_SDK_DISABLED``) plus two Tandem settings that the CLI
exposes as flags: ``--otlp-endpoint`` and ``--trace-file`` (``TANDEM_TRACE_FILE``).

Names used on spans are listed in docs/observability.md. Never put prompt text, token ids
or image bytes on a span: attributes are counts, sizes, hash prefixes and timings.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

TRACE_FILE_ENV = "TANDEM_TRACE_FILE"
INSTRUMENTATION_NAME = "tandem"

# W3C trace context, used for the scheduler -> worker hop whatever OTEL_PROPAGATORS says:
# StepRequest.trace_context is defined as request_id -> traceparent.
_W3C = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None


def endpoint_from_env() -> str:
    """The OTLP endpoint the standard variables name ("" when none)."""
    return (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""))


def setup(service_name: str, endpoint: str | None = None, trace_file: str | None = None) -> bool:
    """Install the global tracer provider for this process; returns whether tracing is on.

    ``endpoint`` (OTLP/gRPC, ``host:port`` or a URL) and ``trace_file`` default to the
    environment (:func:`endpoint_from_env`, ``TANDEM_TRACE_FILE``); pass "" to turn one
    off explicitly. ``service_name`` is ``tandem-scheduler``, ``tandem-worker`` or
    ``tandem-operator`` (``OTEL_SERVICE_NAME`` overrides it); ``OTEL_RESOURCE_ATTRIBUTES``
    adds the rest (``k8s.*``, ``tandem.cell``). Calling it again in the same process
    changes nothing.
    """
    global _provider
    if _provider is not None:
        return True
    endpoint = endpoint_from_env() if endpoint is None else endpoint
    trace_file = os.environ.get(TRACE_FILE_ENV, "") if trace_file is None else trace_file
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or not (
            endpoint or trace_file):
        return False
    # OTEL_SERVICE_NAME, when set, names the service as the specification says it should.
    named = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(named))
    if endpoint:
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(endpoint)))
    if trace_file:
        provider.add_span_processor(BatchSpanProcessor(OtlpJsonFileExporter(trace_file)))
    trace.set_tracer_provider(provider)
    _provider = provider
    log.info("tracing on as %s (endpoint %r, trace file %r)", service_name, endpoint, trace_file)
    return True


def _otlp_exporter(endpoint: str) -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
    if protocol != "grpc":
        log.warning("OTLP protocol %r is not supported; exporting with grpc", protocol)
    # NOTE: a bare host:port would parse as a URL scheme and make the exporter use TLS;
    # local collectors (Phoenix, the chart's collector) are plaintext, so plain means http.
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    return OTLPSpanExporter(endpoint=endpoint)


def enabled() -> bool:
    return _provider is not None


def tracer() -> trace.Tracer:
    """The process's tracer (a no-op one when tracing is off)."""
    return trace.get_tracer(INSTRUMENTATION_NAME)


def shutdown() -> None:
    """Export what is buffered and stop the exporters (call once, on the way out)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


# --- trace context ---------------------------------------------------------------------

def context_from_metadata(
        metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The caller's context from gRPC metadata (``traceparent``/``tracestate``)."""
    carrier = {k: v for k, v in metadata or () if isinstance(v, str)}
    return propagate.extract(carrier)


def traceparent(span: trace.Span) -> str:
    """``span`` as a W3C traceparent header value ("" for an invalid span)."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def link_to(traceparent_value: str, attributes: dict[str, Any] | None = None) -> trace.Link | None:
    """A span link to the span a traceparent names (None if it does not parse)."""
    ctx = _W3C.extract({"traceparent": traceparent_value})
    span_context = trace.get_current_span(ctx).get_span_context()
    return trace.Link(span_context, attributes) if span_context.is_valid else None


# --- the gRPC server span -----------------------------------------------------------------

class ServerSpanInterceptor(grpc.aio.ServerInterceptor):
    """One SERVER span per call of the named services, parented by the caller's context.

    Health and reflection are left out by naming only the services to trace. Install it
    first (outermost), so it sees the status the error-mapping interceptor sets. The span
    is the current span while the method runs, so spans the servicer starts are children.
    """

    def __init__(self, services: Sequence[str], tracer_: trace.Tracer | None = None) -> None:
        self._services = frozenset(services)
        self._tracer = tracer_ or tracer()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        service, _, method = details.method.lstrip("/").rpartition("/")
        if handler is None or service not in self._services:
            return handler
        parent = context_from_metadata(details.invocation_metadata)
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}

        def start() -> trace.Span:
            return self._tracer.start_span(details.method, parent, kind=trace.SpanKind.SERVER,
                                           attributes=attributes)

        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _traced_stream(handler.unary_stream, start),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _traced_unary(handler.unary_unary, start),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler


def _traced_unary(fn: Callable[..., Awaitable[Any]],
                  start: Callable[[], trace.Span]) -> Callable[..., Awaitable[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        span = start()
        error: BaseException | None = None
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            return await fn(request, context)
        except BaseException as exc:
            error = exc
            raise
        finally:
            otel_context.detach(token)
            _end_server_span(span, context, error)

    return call


def _traced_stream(fn: Callable[..., AsyncIterator[Any]],
                   start: Callable[[], trace.Span]) -> Callable[..., AsyncIterator[Any]]:
    """The span is current only while the handler runs, never across a ``yield``.

    NOTE: attaching once around the whole loop fails when the client cancels: the
    generator is then closed from another context and the detach raises. Attaching per
    ``__anext__`` keeps every attach and its detach in the same task.
    """

    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        span = start()
        span_context = trace.set_span_in_context(span)
        error: BaseException | None = None
        responses = fn(request, context)
        try:
            while True:
                token = otel_context.attach(span_context)
                try:
                    item = await anext(responses)
                except StopAsyncIteration:
                    return
                finally:
                    otel_context.detach(token)
                yield item
        except BaseException as exc:
            error = exc
            raise
        finally:
            _end_server_span(span, context, error)

    return call


def _end_server_span(span: trace.Span, context: grpc.aio.ServicerContext,
                     error: BaseException | None) -> None:
    """Status from the context (set by abort), else from how the handler ended."""
    code = context.code()
    if not isinstance(code, grpc.StatusCode):
        if error is None:
            code = grpc.StatusCode.OK
        elif isinstance(error, GeneratorExit | asyncio.CancelledError):
            code = grpc.StatusCode.CANCELLED
        else:
            code = grpc.StatusCode.UNKNOWN
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        span.set_attribute("error.type", code.name)  # never the message: it may quote input
        span.set_status(trace.StatusCode.ERROR)
    span.end()


# --- the trace file -------------------------------------------------------------------------

class OtlpJsonFileExporter(SpanExporter):
    """Appends finished spans to a file as OTLP JSON lines (one ``TracesData`` per batch).

    The format is the OTLP/JSON encoding the OpenTelemetry Collector's file exporter
    writes (ids in hex, enums as integers), so the file can be replayed into any backend;
    ``tandem traces`` reads it. Several processes (a cell's scheduler and workers) may
    append to one file: each batch is one ``write`` on an ``O_APPEND`` descriptor, which
    keeps lines whole.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        line = json.dumps(traces_to_json(encode_spans(spans)), separators=(",", ":")) + "\n"
        try:
            os.write(self._fd, line.encode())
        except OSError:
            log.exception("could not write the trace file")
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def traces_to_json(message: Any) -> dict[str, Any]:
    """An OTLP trace message as OTLP/JSON: camelCase, integer enums, hex trace/span ids."""
    data = MessageToDict(message, use_integers_for_enums=True)
    for resource_spans in data.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                _hex_ids(span, ("traceId", "spanId", "parentSpanId"))
                for link in span.get("links", ()):
                    _hex_ids(link, ("traceId", "spanId"))
    return data


def _hex_ids(obj: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        if key in obj:
            obj[key] = base64.b64decode(obj[key]).hex()
