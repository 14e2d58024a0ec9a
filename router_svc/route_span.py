"""The endpoint picker's ``tandem.route`` span: one per request it picks a cell for.

The picker relays no bytes, so its span covers what the picker adds to a request: from
the request headers to the pick (buffering the body, the routing key, the balancer's
choice) or the refusal. It is a child of the client's ``traceparent`` when the request
carries one, and its own context goes on to the cell in the ``traceparent`` request
header, set by the picker's header answer: the cell's server span sits under the pick
(and starts as the pick ends).

With tracing off (:func:`tandem.tracing.enabled`) nothing is started or sent.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import propagate, trace

from router_svc.balancer import Balancer, RouteDecision
from tandem import tracing
from tandem.errors import TandemError

tracer = trace.get_tracer("tandem.epp")


class RouteSpan:
    """One request's pick, traced; every method is a no-op while tracing is off.

    Ended exactly once, by :meth:`end` (the span's own end guards against a second)."""

    def __init__(self, request_headers: Mapping[str, str]) -> None:
        self._span = tracer.start_span(
            "tandem.route", tracing.context_from_metadata(request_headers.items()),
            kind=trace.SpanKind.CLIENT) if tracing.enabled() else None

    def picked(self, decision: RouteDecision, balancer: Balancer) -> dict[str, str]:
        """Record the decision and the chosen cell's load (its in-flight slots here, this
        one included, and the requests in flight it last reported); returns the headers
        that carry this span's context to the cell (none while tracing is off)."""
        if self._span is None:
            return {}
        self._span.set_attributes({**decision.span_attributes(),
                                   "tandem.route.in_flight": balancer.in_flight[decision.cell],
                                   "tandem.route.queued": balancer.queued[decision.cell]})
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(self._span))
        return carrier

    def refused(self, error: TandemError) -> None:
        if self._span is not None:
            self._span.set_attribute("error.type", error.code.name)  # never the message
            self._span.set_status(trace.StatusCode.ERROR)

    def end(self) -> None:
        if self._span is not None:
            self._span.end()
