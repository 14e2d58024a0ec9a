"""A real OTLP/gRPC trace endpoint for tests (opentelemetry-proto's TraceService).

The services under test export to it with the real OTLP exporter; it keeps every span,
decoded through the same OTLP/JSON path as the trace file (``tandem.tracing``), so tests
read :class:`tandem_cli.traces_view.Span` objects.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tandem.tracing import traces_to_json
from tandem_cli.traces_view import Span, spans_from_otlp_json


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects exported spans; ``endpoint`` is ``127.0.0.1:<port>``."""

    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{port}"

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        spans = list(spans_from_otlp_json(traces_to_json(request)))
        with self._lock:
            self._spans.extend(spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, done: Callable[[list[Span]], bool], timeout: float = 10.0) -> list[Span]:
        """The spans once ``done(spans)`` holds; the spans so far after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not done(spans := self.spans()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return spans

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(0)
