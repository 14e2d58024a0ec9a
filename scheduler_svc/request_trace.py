"""The spans a request carries while tracing is on: ``generate_content {model}`` and one
``tandem.mm.process`` child per image.

The span follows the GenAI semantic conventions plus Tandem's cache attributes; what
happens to the request in between is recorded as events (``queued``,
``prefix_cache_lookup``, ``scheduled``, ``stripped``, ``preempted``, ``first_token``),
not spans per step, because a step serves many requests (the worker's step spans link
back instead). :mod:`scheduler_svc.request_telemetry` decides which events and
attributes; this module only holds the spans, so a request can carry one without
depending on the scheduler.

Spans exist only while tracing is on: elsewhere ``Request.trace`` is None. Attributes are
counts, sizes, hash prefixes and timings, never prompt text, token ids or image bytes.

An image span covers the image's delivery (lookup, processing, store), but ends with the
request: what the encoder did with the image and how much of it the prefix cache served
are known only once the request was scheduled, and an ended span takes no attributes.
NOTE: it is ended with the time its delivery finished (``end_time``), so its duration is
still the delivery's; the rejected alternative, a second span per image for the
attribution, would split one image's facts across two spans.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from tandem import tracing
from tandem.errors import TandemError
from tandem.features import FeatureData, MultiModalKwargsItem
from tandem.shm import ShmDescriptor
from tandem.v1 import generate_pb2

HASH_PREFIX_CHARS = 16


class ImageSpan:
    """Records how one image reached the request (``tandem.mm.process``)."""

    def __init__(self, span: trace.Span | None) -> None:
        self.span = span

    def done(self, result: str, refused_reason: str, transport: str,
             data: FeatureData) -> None:
        """The delivery's outcome: the processor cache's ``result`` (hit, miss, refused for
        ``refused_reason``), the ``transport`` (shm, inline) and the ``data`` sent."""
        if self.span is None:
            return
        self.span.set_attributes({"tandem.mm.cache.result": result,
                                  "tandem.mm.transport": transport})
        if refused_reason:
            self.span.set_attribute("tandem.mm.cache.refused_reason", refused_reason)
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
        self._images: list[tuple[trace.Span, int]] = []  # delivered: (span, its end in ns)
        self.span = tracing.tracer().start_span(
            f"generate_content {model}", kind=trace.SpanKind.INTERNAL, attributes=attributes)
        self.traceparent = tracing.traceparent(self.span)

    def event(self, name: str, attributes: dict[str, int | float | str] | None = None) -> None:
        self.span.add_event(name, attributes)

    @contextmanager
    def image(self, key: str, num_tokens: int, size: int) -> Iterator[ImageSpan]:
        """The image's span; ``size``: its data as the client sent it, in bytes."""
        span = tracing.tracer().start_span(
            "tandem.mm.process", context=trace.set_span_in_context(self.span),
            attributes={"tandem.mm.hash": key[:HASH_PREFIX_CHARS], "tandem.mm.modality": "image",
                        "tandem.mm.num_tokens": num_tokens, "tandem.mm.bytes": size})
        try:
            yield ImageSpan(span)
        except BaseException as exc:
            _set_error(span, exc)
            span.end()
            raise
        self._images.append((span, time.time_ns()))  # ended by end(), at this time

    def end(self, attributes: Mapping[str, AttributeValue], error: BaseException | None,
            images: Sequence[Mapping[str, AttributeValue]] = ()) -> None:
        """Set the final ``attributes`` (usage, cache figures) and the error, if any; end.

        ``images`` holds the final attributes of each delivered image, in prompt order
        (shorter when the request ended before it was scheduled)."""
        for i, (span, ended) in enumerate(self._images):
            if i < len(images):
                span.set_attributes(images[i])
            span.end(end_time=ended)
        self._images = []
        self.span.set_attributes(attributes)
        if error is not None:
            _set_error(self.span, error)
        self.span.end()


def image_span(trace_: RequestTrace | None, key: str, num_tokens: int,
               size: int) -> AbstractContextManager[ImageSpan]:
    """The image's span under ``trace_``, or a do-nothing one when the request is untraced."""
    if trace_ is None:
        return nullcontext(_NO_IMAGE_SPAN)
    return trace_.image(key, num_tokens, size)


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
