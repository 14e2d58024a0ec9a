"""GenerateRequest -> Request: validate and tokenize; how images are turned into items.

The checks run in the order a user fixes things (prompt, images, sampling), each failing
with :class:`~tandem.errors.InvalidInput` and a message naming the limit. The token count
of an image comes from its header alone, so a processor-cache hit costs no decoding: the
delivery ledger (:mod:`scheduler_svc.delivery`) calls :meth:`InputProcessor.process` only
on a miss.
"""

from __future__ import annotations

import io
import uuid
from dataclasses import dataclass

import numpy as np
from PIL import Image

from scheduler_svc.config import Limits
from scheduler_svc.image_processor import (
    ImageProcessorConfig,
    decode_image,
    mm_hash,
    mm_hash_from_uuid,
    process_image,
    smart_resize,
)
from scheduler_svc.request import Request, Sampling
from scheduler_svc.request_trace import RequestTrace
from tandem import tokenizer
from tandem.errors import InvalidInput
from tandem.feature_codec import tensor_from_proto
from tandem.features import (
    FieldElem,
    MultiModalFeatureSpec,
    MultiModalKwargsItem,
    PlaceholderRange,
)
from tandem.v1 import generate_pb2


@dataclass(frozen=True, slots=True)
class _Image:
    key: str
    num_tokens: int
    media: generate_pb2.MediaItem


class InputProcessor:
    def __init__(self, limits: Limits, images: ImageProcessorConfig, max_model_tokens: int) -> None:
        self.limits = limits
        self.images = images
        self.max_model_tokens = max_model_tokens  # prompt + outputs must fit the KV pool

    def to_request(self, msg: generate_pb2.GenerateRequest,
                   trace: RequestTrace | None = None) -> Request:
        """A validated Request; its features get their data from the delivery ledger.

        Every image is checked from its header here (a bad one fails before any is
        processed); decoding and processing happen only on a processor-cache miss.
        """
        sampling = self.sampling(msg)
        prompt_ids, images = self._prompt_and_images(msg)
        token_ids, features = self._expand(prompt_ids, images)
        if len(token_ids) > self.limits.max_prompt_tokens:
            raise InvalidInput(f"prompt is {len(token_ids)} tokens with images expanded; the "
                               f"limit is {self.limits.max_prompt_tokens}", "PROMPT_TOO_LONG")
        if len(token_ids) + sampling.max_tokens > self.max_model_tokens:
            raise InvalidInput(f"prompt ({len(token_ids)} tokens) plus max_tokens "
                               f"({sampling.max_tokens}) exceeds the KV cache of "
                               f"{self.max_model_tokens} tokens", "CONTEXT_TOO_LONG")
        return Request(
            request_id=msg.request_id or uuid.uuid4().hex, token_ids=token_ids,
            num_prompt_tokens=len(token_ids), features=features, sampling=sampling,
            cache_salt=msg.cache_salt, media=list(msg.images), trace=trace,
        )

    def sampling(self, msg: generate_pb2.GenerateRequest) -> Sampling:
        s, lim = msg.sampling, self.limits
        max_tokens = s.max_tokens if s.HasField("max_tokens") else lim.default_max_tokens
        if not 1 <= max_tokens <= lim.max_tokens:
            raise InvalidInput(f"max_tokens must be in 1..{lim.max_tokens}, got {max_tokens}",
                               "BAD_SAMPLING")
        if not s.temperature >= 0:
            raise InvalidInput(f"temperature must be >= 0, got {s.temperature}", "BAD_SAMPLING")
        top_p = s.top_p if s.HasField("top_p") else 1.0
        if not 0 < top_p <= 1:
            raise InvalidInput(f"top_p must be in (0, 1], got {top_p}", "BAD_SAMPLING")
        if s.top_k < -1:
            raise InvalidInput(f"top_k must be >= -1 (0 or -1 disable it), got {s.top_k}",
                               "BAD_SAMPLING")
        bad_stop = [t for t in s.stop_token_ids if t >= tokenizer.VOCAB_SIZE]
        if bad_stop:
            raise InvalidInput(f"stop_token_ids {bad_stop} are outside the vocabulary of "
                               f"{tokenizer.VOCAB_SIZE}", "BAD_SAMPLING")
        return Sampling(max_tokens, s.temperature, top_p, max(s.top_k, 0),
                        s.seed if s.HasField("seed") else None, frozenset(s.stop_token_ids),
                        s.ignore_eos)

    def process(self, media: generate_pb2.MediaItem) -> MultiModalKwargsItem:
        """Decode and process one image (CPU-heavy: call through the offload)."""
        source = (decode_image(media.encoded, self.images) if media.HasField("encoded")
                  else _pixels(media))
        pixel_values, grid = process_image(source, self.images)
        return MultiModalKwargsItem({
            "pixel_values": FieldElem(pixel_values),
            "image_grid_thw": FieldElem(grid, keep_on_cpu=True),
        })

    def _prompt_and_images(
        self, msg: generate_pb2.GenerateRequest
    ) -> tuple[list[int], list[_Image]]:
        if not msg.prompt:
            raise InvalidInput("prompt is empty", "EMPTY_PROMPT")
        markers = tokenizer.count_image_markers(msg.prompt)
        if len(msg.images) > self.limits.max_images:
            raise InvalidInput(f"{len(msg.images)} images; the limit is "
                               f"{self.limits.max_images} per request", "TOO_MANY_IMAGES")
        if markers != len(msg.images):
            raise InvalidInput(f"the prompt has {markers} {tokenizer.IMAGE_MARKER} markers but "
                               f"{len(msg.images)} images were sent", "IMAGE_COUNT_MISMATCH")
        images = [self._image(i, m, msg.cache_salt) for i, m in enumerate(msg.images)]
        return tokenizer.encode(msg.prompt), images

    def _image(self, index: int, media: generate_pb2.MediaItem, salt: str) -> _Image:
        kind = media.WhichOneof("data")
        if kind is None:
            raise InvalidInput(f"image {index} has no data", "IMAGE_EMPTY")
        if kind == "encoded":
            height, width = _header_size(media.encoded, self.images)
            key = mm_hash(media.encoded, self.images, salt)
        else:
            pixels = _pixels(media)
            height, width = pixels.shape[:2]
            key = mm_hash(pixels, self.images, salt)
        h, w = smart_resize(height, width, self.images)
        if media.HasField("uuid"):
            key = mm_hash_from_uuid(media.uuid, salt, (h, w))
        merge = self.images.merge_size * self.images.patch_size
        return _Image(key, (h // merge) * (w // merge), media)

    @staticmethod
    def _expand(prompt_ids: list[int], images: list[_Image]
                ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """Replace each IMAGE placeholder by the image's token count; one feature each."""
        token_ids: list[int] = []
        features: list[MultiModalFeatureSpec] = []
        for t in prompt_ids:
            if t != tokenizer.IMAGE_ID:
                token_ids.append(t)
                continue
            im = images[len(features)]
            pos = PlaceholderRange(len(token_ids), im.num_tokens)
            features.append(MultiModalFeatureSpec(im.key, "image", pos, None))
            token_ids.extend([tokenizer.IMAGE_ID] * im.num_tokens)
        return token_ids, features


def _header_size(data: bytes, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """(height, width) from the image header, without decoding the pixels."""
    if len(data) > cfg.max_image_bytes:
        raise InvalidInput(f"image is {len(data)} bytes; the limit is {cfg.max_image_bytes}",
                           "IMAGE_TOO_LARGE")
    try:
        with Image.open(io.BytesIO(data), formats=("PNG", "JPEG")) as img:
            width, height = img.size
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidInput("image is not a readable PNG or JPEG", "IMAGE_CORRUPT") from exc
    if width * height > cfg.max_image_pixels:
        raise InvalidInput(f"image is {width}x{height} pixels; the limit is "
                           f"{cfg.max_image_pixels} pixels", "IMAGE_TOO_LARGE")
    return height, width


def _pixels(media: generate_pb2.MediaItem) -> np.ndarray:
    """The raw-tensor image as a float array (shape and value checks happen in processing)."""
    t = tensor_from_proto(media.tensor)
    if not t.is_floating_point():
        raise InvalidInput(f"image tensor must be float, got {media.tensor.dtype}",
                           "IMAGE_TENSOR")
    if t.dim() != 3 or t.shape[2] != 3 or t.shape[0] == 0 or t.shape[1] == 0:
        raise InvalidInput(f"image tensor must be shaped (height, width, 3), got "
                           f"{list(t.shape)}", "IMAGE_TENSOR")
    return t.float().numpy()
