"""Per-image attribution: where each image's work came from, for ``Usage.images`` and the
image's ``tandem.mm.process`` span.

Each fact is recorded where it is known, on the request's :class:`ImageRecord` list (one
per feature, in prompt order):

* processor cache and transport: by the delivery ledger when it first acquires the
  request's images (:meth:`ImageRecord.delivered`). A preempted request's re-delivery is
  not re-attributed: the record, like the span, tells the first delivery;
* encoder: by the scheduler each time it commits a chunk that reaches the image
  (:func:`record_encoder`): ``ran`` (encoded for this request), ``cached`` (the workers'
  encoder cache had it) or ``skipped`` (its span lies inside the computed prefix: no worker
  needs it). When a preempted request is scheduled again the strongest outcome stays
  (ran > cached > skipped): work done for the request is not forgotten;
* cached tokens: the image's placeholder tokens inside the prefix-cache hit of the
  request's first scheduling (``Request.num_cached_tokens``), computed at the end.

An image the request never reached (it ended first) keeps an unspecified encoder result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.util.types import AttributeValue

from tandem.features import FeatureData, MultiModalFeatureSpec
from tandem.shm import ShmDescriptor
from tandem.v1 import generate_pb2

HIT, MISS, REFUSED = "hit", "miss", "refused"
SHM, INLINE = "shm", "inline"
RAN, CACHED, SKIPPED = "ran", "cached", "skipped"
_ENCODER_RANK = {"": 0, SKIPPED: 1, CACHED: 2, RAN: 3}  # a later decision never weakens one

_CACHE_PROTO = {"": generate_pb2.PROCESSOR_CACHE_RESULT_UNSPECIFIED,
                HIT: generate_pb2.PROCESSOR_CACHE_RESULT_HIT,
                MISS: generate_pb2.PROCESSOR_CACHE_RESULT_MISS,
                REFUSED: generate_pb2.PROCESSOR_CACHE_RESULT_REFUSED}
_TRANSPORT_PROTO = {"": generate_pb2.IMAGE_TRANSPORT_UNSPECIFIED,
                    SHM: generate_pb2.IMAGE_TRANSPORT_SHM,
                    INLINE: generate_pb2.IMAGE_TRANSPORT_INLINE}
_ENCODER_PROTO = {"": generate_pb2.ENCODER_RESULT_UNSPECIFIED,
                  RAN: generate_pb2.ENCODER_RESULT_RAN,
                  CACHED: generate_pb2.ENCODER_RESULT_CACHED,
                  SKIPPED: generate_pb2.ENCODER_RESULT_SKIPPED}


@dataclass(slots=True)
class ImageRecord:
    """What happened to one image of a request ("" = not known yet).

    ``cache`` and ``transport`` are written once, by the ledger's first delivery;
    ``encoder`` only ever strengthens (see the module docstring).
    """

    key: str  # the processor-cache key (the feature's identifier)
    offset: int  # placeholder span [offset, offset + tokens) in the prompt
    tokens: int
    cache: str = ""  # hit | miss | refused
    refused_reason: str = ""  # with refused: the cache's reason ("oversize", "full"...)
    transport: str = ""  # shm | inline
    encoder: str = ""  # ran | cached | skipped

    @classmethod
    def of(cls, feature: MultiModalFeatureSpec) -> ImageRecord:
        return cls(feature.identifier, feature.mm_position.offset, feature.mm_position.length)

    def delivered(self, hit: bool, data: FeatureData, refusal: str) -> None:
        """The first delivery's outcome: ``hit`` from the cache, else processed now and
        stored, or not kept for ``refusal`` (the cache's reason, "" when it kept it)."""
        if self.cache:
            raise RuntimeError(f"image {self.key[:16]} attributed twice")
        self.cache = HIT if hit else (REFUSED if refusal else MISS)
        self.refused_reason = "" if hit else refusal
        self.transport = SHM if isinstance(data, ShmDescriptor) else INLINE

    def encoded(self, result: str) -> None:
        if _ENCODER_RANK[result] > _ENCODER_RANK[self.encoder]:
            self.encoder = result

    def cached_tokens(self, num_cached_tokens: int) -> int:
        """Tokens of the placeholder span inside a prefix hit of ``num_cached_tokens``."""
        return min(max(num_cached_tokens - self.offset, 0), self.tokens)

    def span_attributes(self, num_cached_tokens: int) -> dict[str, AttributeValue]:
        """The facts known at the end, for the image's span (docs/observability.md)."""
        out: dict[str, AttributeValue] = {
            "tandem.mm.encoder.result": self.encoder or "unknown",
            "tandem.mm.cached_tokens": self.cached_tokens(num_cached_tokens)}
        return out

    def to_proto(self, num_cached_tokens: int) -> generate_pb2.ImageUsage:
        return generate_pb2.ImageUsage(
            key=self.key, processor_cache=_CACHE_PROTO[self.cache],
            refused_reason=self.refused_reason, transport=_TRANSPORT_PROTO[self.transport],
            encoder=_ENCODER_PROTO[self.encoder],
            cached_tokens=self.cached_tokens(num_cached_tokens), tokens=self.tokens)


def record_encoder(images: Sequence[ImageRecord], features: Sequence[MultiModalFeatureSpec],
                   computed: int, n: int, encode: Sequence[int]) -> None:
    """A committed chunk computes tokens ``[computed, computed + n)`` and encodes the
    features ``encode``: every image the chunk reaches gets its encoder outcome.

    The predicate is the scheduler's own: an image is covered (``skipped``) when
    ``is_covered(computed)``, else encoded now (``ran``) or found in the encoder cache.
    """
    for i, f in enumerate(features):
        if f.mm_position.offset >= computed + n:
            break
        images[i].encoded(RAN if i in encode else SKIPPED if f.is_covered(computed) else CACHED)


def usage_images(images: Sequence[ImageRecord],
                 num_cached_tokens: int) -> list[generate_pb2.ImageUsage]:
    """``Usage.images``: one entry per image, in prompt order."""
    cached = max(num_cached_tokens, 0)
    return [r.to_proto(cached) for r in images]
