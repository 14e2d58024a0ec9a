"""What one Generate call reports: its ``generate_content {model}`` span and its latency.

The span follows the GenAI semantic conventions (attributes set at the end, when usage is
known) plus Tandem's cache attributes, one ``tandem.mm.process`` child per image, and
events for what happened to the request in between (``queued``, ``prefix_cache_lookup``,
``scheduled``, ``stripped``, ``preempted``, ``first_token``). Events rather than spans per
step, because a step serves many requests; the worker's step spans link back instead.

Spans exist only while tracing is on: elsewhere ``Request.trace`` is None. Attributes are
counts, sizes, hash prefixes and timings, never prompt text, token ids or image bytes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import TracebackType
from typing import TYPE_CHECKING

from opentelemetry import trace

from tandem import tracing
from tandem.errors import TandemError
from tandem.features import FeatureData, MultiModalKwargsItem
from tandem.metrics import RequestLatency
from tandem.shm import ShmDescriptor
from tandem.v1 import generate_pb2

if TYPE_CHECKING:
    from scheduler_svc.request import Request
    from scheduler_svc.scheduler import SchedulerOutput

HASH_PREFIX_CHARS = 16


class ImageSpan:
    """Records how one image reached the request (``tandem.mm.process``)."""

    def __init__(self, span: trace.Span | None) -> None:
        self.span = span

    def done(self, cache_kind: str, hit: bool, data: FeatureData) -> None:
        """``hit``: the cache had it. Otherwise it was processed now, and stored (miss) or
        sent inline because no cache took it (bypass: cache ``none``, or a refused put)."""
        if self.span is None:
            return
        refused = cache_kind == "shm" and not isinstance(data, ShmDescriptor)
        result = "hit" if hit else ("bypass" if cache_kind == "none" or refused else "miss")
        self.span.set_attribute("tandem.mm.cache.result", result)
        if isinstance(data, ShmDescriptor):
            self.span.set_attributes({
                "tandem.shm.address": data.address, "tandem.shm.monotonic_id": data.monotonic_id,
                "tandem.shm.object_bytes": data.nbytes,
                # hex: the generation is a random u64, beyond the int64 attributes allow
                "tandem.shm.segment_generation": f"{data.generation:016x}"})
        elif isinstance(data, MultiModalKwargsItem):
            self.span.set_attribute("tandem.mm.processed_bytes", data.nbytes)


_NO_IMAGE_SPAN = ImageSpan(None)


class RequestTrace:
    """The ``generate_content {model}`` span of one request (started when the call arrives)."""

    def __init__(self, model: str, msg: generate_pb2.GenerateRequest) -> None:
        s = msg.sampling
        attributes: dict[str, str | bool | int | float] = {
            "gen_ai.operation.name": "generate_content", "gen_ai.provider.name": "tandem",
            "gen_ai.request.model": model, "gen_ai.request.temperature": s.temperature,
            "tandem.cache_salt.set": bool(msg.cache_salt), "tandem.mm.items": len(msg.images)}
        if s.top_k > 0:
            attributes["gen_ai.request.top_k"] = s.top_k
        for name in ("max_tokens", "top_p", "seed"):
            if s.HasField(name):
                attributes[f"gen_ai.request.{name}"] = getattr(s, name)
        self.model = model
        self.span = tracing.tracer().start_span(
            f"generate_content {model}", kind=trace.SpanKind.INTERNAL, attributes=attributes)
        self.traceparent = tracing.traceparent(self.span)

    def event(self, name: str, attributes: dict[str, int | float | str] | None = None) -> None:
        self.span.add_event(name, attributes)

    @contextmanager
    def image(self, key: str, num_tokens: int,
              media: generate_pb2.MediaItem) -> Iterator[ImageSpan]:
        size = len(media.encoded) if media.HasField("encoded") else media.tensor.ByteSize()
        span = tracing.tracer().start_span(
            "tandem.mm.process", context=trace.set_span_in_context(self.span),
            attributes={"tandem.mm.hash": key[:HASH_PREFIX_CHARS], "tandem.mm.modality": "image",
                        "tandem.mm.num_tokens": num_tokens, "tandem.mm.bytes": size})
        try:
            yield ImageSpan(span)
        except BaseException as exc:
            _set_error(span, exc)
            raise
        finally:
            span.end()

    def end(self, request: Request | None, error: BaseException | None) -> None:
        """Usage and cache attributes from ``request`` (None if it was rejected), then end."""
        if request is not None:
            self.span.set_attributes(_usage_attributes(request, self.model))
        if error is not None:
            _set_error(self.span, error)
        self.span.end()


def image_span(trace_: RequestTrace | None, key: str, num_tokens: int,
               media: generate_pb2.MediaItem) -> AbstractContextManager[ImageSpan]:
    """The image's span under ``trace_``, or a do-nothing one when the request is untraced."""
    if trace_ is None:
        return nullcontext(_NO_IMAGE_SPAN)
    return trace_.image(key, num_tokens, media)


def _usage_attributes(request: Request, model: str) -> dict[str, str | int | float | list[str]]:
    cached = max(request.num_cached_tokens, 0)
    items = len(request.features)
    attributes: dict[str, str | int | float | list[str]] = {
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
    if request.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:  # else: cut short
        reason = generate_pb2.FinishReason.Name(request.finish_reason)
        attributes["gen_ai.response.finish_reasons"] = [reason.removeprefix("FINISH_REASON_")
                                                        .lower()]
    return attributes


def _set_error(span: trace.Span, error: BaseException) -> None:
    # A fixed code, not the message: messages may quote client input.
    span.set_attribute("error.type", _error_type(error))
    span.set_status(trace.StatusCode.ERROR)


def _error_type(error: BaseException) -> str:
    if isinstance(error, TandemError):
        return error.reason
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return "cancelled"
    return type(error).__name__


def step_trace_context(out: SchedulerOutput, requests: Mapping[str, Request],
                       block_size: int) -> dict[str, str]:
    """Record the step's scheduling events; request_id -> traceparent of its requests.

    ``out.finished_request_ids`` mixes finished requests (already gone from ``requests``)
    with preempted ones (still known, waiting again): only the latter get ``preempted``.
    """
    for request_id in out.finished_request_ids:
        request = requests.get(request_id)
        if request is not None and request.trace is not None:
            request.trace.event("preempted", {"preemptions": request.preemptions})
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
        covered = [f for f in request.features if computed and f.is_covered(computed)]
        if covered:
            stripped = sum(isinstance(f.data, MultiModalKwargsItem) for f in covered)
            request.trace.event("stripped", {"items": stripped, "covered": len(covered),
                                             "by_reference": len(covered) - stripped})
    return {rid: t.traceparent for rid in out.num_scheduled_tokens
            if (t := requests[rid].trace) is not None}


class RequestTelemetry:
    """One Generate call's span and latency; the servicer feeds it each output.

    Used as a context manager around the call: leaving it ends the span (with the error,
    if any) and, for a call that completed, observes the latency histograms.
    """

    def __init__(self, model: str, msg: generate_pb2.GenerateRequest,
                 latency: RequestLatency | None) -> None:
        self.start = time.monotonic()
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
        if self.trace is not None:
            self.trace.end(self.request, error)
        if self._latency is not None and error is None and self.request is not None:
            ttft = None if self._first_token is None else self._first_token - self.start
            self._latency.observe(ttft, time.monotonic() - self.start,
                                  self.request.num_output_tokens)
