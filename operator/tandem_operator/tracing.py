"""One span per handler run, through the OpenTelemetry API only.

Without an installed tracer provider the API hands out no-op spans, so this costs nothing until
the process configures an exporter (OTEL_EXPORTER_OTLP_ENDPOINT, wired by the observability
work); the operator imports no SDK itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import Span


@contextmanager
def handler_span(handler: str, namespace: str, name: str) -> Iterator[Span]:
    """`tandem_operator.<handler>` with the object's identity; exceptions are recorded."""
    tracer = trace.get_tracer("tandem_operator")
    attributes = {"k8s.namespace.name": namespace, "tandem.service": name}
    with tracer.start_as_current_span(f"tandem_operator.{handler}", attributes=attributes) as span:
        yield span
