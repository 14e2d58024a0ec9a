"""What a Generate call reports: the events and attributes of its span, and its latency.

The spans themselves live in :mod:`scheduler_svc.request_trace`; this module decides what
goes on them, from what the scheduler and the step builder say happened: the scheduler
output keeps preempted and finished requests apart, and the builder reports what it
stripped, so nothing here re-derives either.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import TracebackType

from opentelemetry.util.types import AttributeValue

from scheduler_svc.request import Request
from scheduler_svc.request_trace import RequestTrace
from scheduler_svc.scheduler import SchedulerOutput
from scheduler_svc.step_message import Stripped
from tandem import tracing
from tandem.metrics import RequestLatency
from tandem.v1 import generate_pb2


def step_trace_context(out: SchedulerOutput, stripped: Mapping[str, Stripped],
                       block_size: int) -> dict[str, str]:
    """Record the step's scheduling events; request_id -> traceparent of its requests.

    ``stripped`` is the step builder's report per new request.
    """
    for preempted in out.preempted:
        if preempted.trace is not None:
            preempted.trace.event("preempted", {"preemptions": preempted.preemptions})
    for new in out.new_requests:
        request = new.request
        if request.trace is None:
            continue
        computed = new.num_computed_tokens
        request.trace.event("prefix_cache_lookup", {
            "hit_blocks": computed // block_size, "total_blocks": len(request.block_hashes),
            "hit_tokens": computed})
        request.trace.event("scheduled", {"tokens": out.num_scheduled_tokens[request.request_id],
                                          "preemptions": request.preemptions})
        s = stripped[request.request_id]
        if s.covered:
            request.trace.event("stripped", {"items": s.dropped, "covered": s.covered,
                                             "by_reference": s.covered - s.dropped})
    return {r.request_id: r.trace.traceparent for r, _ in out.scheduled()
            if r.trace is not None}


def usage_attributes(request: Request, model: str) -> dict[str, AttributeValue]:
    cached = max(request.num_cached_tokens, 0)
    items = len(request.features)
    attributes: dict[str, AttributeValue] = {
        "gen_ai.response.id": request.request_id, "gen_ai.response.model": model,
        "gen_ai.usage.input_tokens": request.num_prompt_tokens,  # cached ones included
        "gen_ai.usage.output_tokens": request.num_output_tokens,
        "gen_ai.usage.cache_read.input_tokens": cached,
        "tandem.mm.items": items, "tandem.mm.cache_hits": request.mm_cache_hits,
        "tandem.mm.encoder_runs": request.encoder_runs,
        "tandem.prefix_cache.hit_ratio": cached / max(request.num_prompt_tokens, 1),
        "tandem.request.preemptions": request.preemptions}
    if items:
        attributes["tandem.mm.cache_hit_ratio"] = request.mm_cache_hits / items
    if request.constraint is not None:
        attributes.update({"tandem.constraint.kind": request.constraint.kind,
                           "tandem.constraint.compile_ms": request.constraint.compile_ms,
                           "tandem.constraint.cache_hit": request.constraint.cache_hit})
    if request.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:  # else: cut short
        reason = generate_pb2.FinishReason.Name(request.finish_reason)
        attributes["gen_ai.response.finish_reasons"] = [reason.removeprefix("FINISH_REASON_")
                                                        .lower()]
    return attributes


class RequestTelemetry:
    """One Generate call's span and latency; the servicer feeds it each output.

    Used as a context manager around the call: leaving it ends the span (with the error,
    if any) and, for a call that completed, observes the latency histograms.
    """

    def __init__(self, model: str, msg: generate_pb2.GenerateRequest,
                 latency: RequestLatency | None) -> None:
        self.start = time.monotonic()
        self.model = model
        self.trace = RequestTrace(model, msg) if tracing.enabled() else None
        self.request: Request | None = None
        self._latency = latency
        self._first_token: float | None = None

    def output(self, request: Request, token_ids: list[int]) -> None:
        self.request = request
        if self._first_token is None and token_ids:
            self._first_token = time.monotonic()
            if self.trace is not None:
                self.trace.event("first_token",
                                 {"time_to_first_token_s": self._first_token - self.start})

    def __enter__(self) -> RequestTelemetry:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.trace is not None:  # a request rejected before it existed has no usage
            request = self.request
            usage = {} if request is None else usage_attributes(request, self.model)
            cached = 0 if request is None else max(request.num_cached_tokens, 0)
            images = [] if request is None else [r.span_attributes(cached)
                                                 for r in request.images]
            self.trace.end(usage, error, images)
        if self._latency is not None and error is None and self.request is not None:
            ttft = None if self._first_token is None else self._first_token - self.start
            self._latency.observe(ttft, time.monotonic() - self.start,
                                  self.request.num_output_tokens)
