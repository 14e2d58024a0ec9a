"""GenerateRequest -> Request: validate, render, tokenize; how images are turned into items.

A request is a plain ``prompt`` (tokenized as is, images at the model's placeholders), its
token ids (``prompt_token_ids``, used as they are), or chat ``messages`` (rendered with
the model's chat template, images where their content parts stand). The checks run in
the order a user fixes things (prompt, images, sampling), each failing with
:class:`~tandem.errors.InvalidInput` and a message naming the limit. The token count
of an image comes from its header alone, so a processor-cache hit costs no decoding: the
delivery ledger (:mod:`scheduler_svc.delivery`) calls :meth:`InputProcessor.process` only
on a miss.

Both run off the event loop (``Offload``): an image's header check and its content hash
read every byte of the file (tens of milliseconds for a 20 MiB image, more when a
request brings eight), which would stop every stream of the cell meanwhile.
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

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
from scheduler_svc.output_text import OutputText
from scheduler_svc.request import Request, Sampling
from scheduler_svc.request_trace import RequestTrace
from tandem.errors import InvalidInput
from tandem.feature_codec import tensor_from_proto
from tandem.features import (
    FieldElem,
    MultiModalFeatureSpec,
    MultiModalKwargsItem,
    PlaceholderRange,
)
from tandem.request_limits import check_image_count
from tandem.sampling import BAD_SAMPLING, check_min_tokens, check_sampling, check_stop_strings
from tandem.structured import ConstraintCompiler, constraint_from_proto
from tandem.text import (
    ChatMessage,
    ContentPart,
    ImagePart,
    TextPart,
    Tokenizer,
    ToolCall,
    encode_chat,
    expand_images,
)
from tandem.v1 import generate_pb2

T = TypeVar("T")


class Offload(Protocol):
    """Runs CPU-heavy image work (header checks, hashing, decoding) off the event loop."""

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]: ...


@dataclass(frozen=True, slots=True)
class _Image:
    key: str
    num_tokens: int
    nbytes: int  # the client's data: the encoded file, or the raw tensor's bytes


class InputProcessor:
    def __init__(self, limits: Limits, images: ImageProcessorConfig, max_model_tokens: int,
                 tokenizer: Tokenizer, vocab_size: int, constraints: ConstraintCompiler) -> None:
        self.limits = limits
        self.images = images
        self.max_model_tokens = max_model_tokens  # prompt + outputs must fit the KV pool
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's embedding rows (>= the tokenizer's ids)
        self.constraints = constraints  # structured output: compiles and caches

    async def to_request(self, msg: generate_pb2.GenerateRequest, offload: Offload,
                         trace: RequestTrace | None = None) -> Request:
        """A validated Request; its features get their data from the delivery ledger.

        Every image is checked from its header and hashed here, through ``offload`` (a bad
        one fails before any is processed); decoding and processing happen only on a
        processor-cache miss.
        """
        sampling = self.sampling(msg)
        constraint = constraint_from_proto(msg.sampling)
        matcher, constraint_use = (
            (None, None) if constraint is None
            else await self.constraints.matcher(constraint, msg.cache_salt))
        prompt_ids, media = self._prompt(msg)
        images = await offload(lambda: self._images(media, msg.cache_salt)) if media else []
        token_ids, spans = expand_images(prompt_ids, self.tokenizer.image,
                                         [im.num_tokens for im in images])
        features = [MultiModalFeatureSpec(im.key, "image", PlaceholderRange(*span), None)
                    for im, span in zip(images, spans, strict=True)]
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
            cache_salt=msg.cache_salt, media=media, trace=trace, matcher=matcher,
            constraint=constraint_use,
            media_bytes=[im.nbytes for im in images],
            text=OutputText(self.tokenizer.incremental_decoder(), sampling.stop,
                            sampling.include_stop_str_in_output, sampling.min_tokens),
        )

    def sampling(self, msg: generate_pb2.GenerateRequest) -> Sampling:
        """The request's sampling with defaults applied, every value checked (the shared
        ranges of :mod:`tandem.sampling`, plus this server's max_tokens limit)."""
        s, lim = msg.sampling, self.limits
        max_tokens = s.max_tokens if s.HasField("max_tokens") else lim.default_max_tokens
        if not 1 <= max_tokens <= lim.max_tokens:
            raise InvalidInput(f"max_tokens must be in 1..{lim.max_tokens}, got {max_tokens}",
                               BAD_SAMPLING)
        if s.top_k < -1:
            raise InvalidInput(f"top_k must be >= -1 (0 or -1 disable it), got {s.top_k}",
                               BAD_SAMPLING)
        sampling = Sampling(
            max_tokens, s.temperature, s.top_p if s.HasField("top_p") else 1.0,
            max(s.top_k, 0), s.seed if s.HasField("seed") else None,
            frozenset(s.stop_token_ids), s.ignore_eos, frozenset(self.tokenizer.special.eos_ids),
            min_tokens=s.min_tokens, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=(s.repetition_penalty if s.HasField("repetition_penalty")
                                else 1.0),
            min_p=s.min_p, logprobs=s.logprobs, top_logprobs=s.top_logprobs,
            stop=tuple(s.stop), include_stop_str_in_output=s.include_stop_str_in_output)
        check_sampling(sampling, self.vocab_size)
        check_min_tokens(sampling.min_tokens, max_tokens)
        check_stop_strings(sampling.stop)
        return sampling

    def process(self, media: generate_pb2.MediaItem) -> MultiModalKwargsItem:
        """Decode and process one image (CPU-heavy: call through the offload)."""
        source = (decode_image(media.encoded, self.images) if media.HasField("encoded")
                  else _pixels(media))
        pixel_values, grid = process_image(source, self.images)
        return MultiModalKwargsItem({
            "pixel_values": FieldElem(pixel_values),
            "image_grid_thw": FieldElem(grid, keep_on_cpu=True),
        })

    def _prompt(self, msg: generate_pb2.GenerateRequest,
                ) -> tuple[list[int], list[generate_pb2.MediaItem]]:
        """The prompt's token ids (image placeholders not yet expanded) and its images."""
        if sum(map(bool, (msg.prompt, msg.prompt_token_ids, msg.messages))) > 1:
            raise InvalidInput("the request sets more than one of prompt, prompt_token_ids "
                               "and messages; send one of them", "PROMPT_AND_MESSAGES")
        if msg.messages:
            if msg.images:
                raise InvalidInput("with messages, images go in the messages' content parts, "
                                   "not in images", "IMAGES_OUTSIDE_MESSAGES")
            messages, media = _chat(msg.messages)
            tools = _tools(msg.tools_json)
        elif msg.prompt or msg.prompt_token_ids:
            media = list(msg.images)
        else:
            raise InvalidInput("the request has neither a prompt nor messages", "EMPTY_PROMPT")
        if msg.tools_json and not msg.messages:
            raise InvalidInput("tools_json needs messages (a chat template renders them)",
                               "TOOLS_WITHOUT_MESSAGES")
        check_image_count(len(media), self.limits.max_images)
        if msg.messages:
            return encode_chat(self.tokenizer, messages, tools), media
        if msg.prompt_token_ids:
            bad = sorted({t for t in msg.prompt_token_ids if t >= self.vocab_size})
            if bad:
                raise InvalidInput(f"prompt_token_ids {bad[:8]} are outside the vocabulary of "
                                   f"{self.vocab_size}", "BAD_TOKEN_ID")
            return list(msg.prompt_token_ids), media
        return self.tokenizer.encode(msg.prompt), media

    def _images(self, media: Sequence[generate_pb2.MediaItem], salt: str) -> list[_Image]:
        """Each image checked from its header and keyed (CPU-heavy: call through the
        offload)."""
        return [self._image(i, m, salt) for i, m in enumerate(media)]

    def _image(self, index: int, media: generate_pb2.MediaItem, salt: str) -> _Image:
        kind = media.WhichOneof("data")
        if kind is None:
            raise InvalidInput(f"image {index} has no data", "IMAGE_EMPTY")
        content: bytes | np.ndarray
        if kind == "encoded":
            content = media.encoded  # NOTE: each read of a bytes field copies it: read once
            nbytes = len(content)
            height, width = _header_size(content, self.images)
        else:
            nbytes = len(media.tensor.data)
            content = _pixels(media)
            height, width = content.shape[:2]
        h, w = smart_resize(height, width, self.images)
        key = (mm_hash_from_uuid(media.uuid, salt, (h, w)) if media.HasField("uuid")
               else mm_hash(content, self.images, salt))
        merge = self.images.merge_size * self.images.patch_size
        return _Image(key, (h // merge) * (w // merge), nbytes)


def _chat(messages: Sequence[generate_pb2.ChatMessage],
          ) -> tuple[list[ChatMessage], list[generate_pb2.MediaItem]]:
    """The conversation for the chat template, and its images in order."""
    turns: list[ChatMessage] = []
    media: list[generate_pb2.MediaItem] = []
    for i, m in enumerate(messages):
        if not m.role:
            raise InvalidInput(f"message {i} has no role", "BAD_MESSAGE")
        parts: list[ContentPart] = []
        for j, part in enumerate(m.content):
            kind = part.WhichOneof("part")
            if kind is None:
                raise InvalidInput(f"message {i} content part {j} is neither text nor an image",
                                   "BAD_MESSAGE")
            if kind == "image":
                media.append(part.image)
                parts.append(ImagePart())
            else:
                parts.append(TextPart(part.text))
        calls = tuple(ToolCall(c.id, c.name, _arguments(c.arguments, i, j))
                      for j, c in enumerate(m.tool_calls))
        turns.append(ChatMessage(m.role, tuple(parts), calls, m.tool_call_id))
    return turns, media


def _arguments(text: str, message: int, call: int) -> dict[str, Any]:
    """A tool call's arguments as the object its JSON encodes: what templates read (as
    vLLM passes them); empty text is no arguments."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError as exc:
        raise InvalidInput(f"message {message} tool call {call}: arguments are not valid "
                           f"JSON ({exc})", "BAD_MESSAGE") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"message {message} tool call {call}: arguments must be a JSON "
                           "object", "BAD_MESSAGE")
    return value


def _tools(text: str) -> list[dict[str, Any]] | None:
    """``tools_json`` as the chat template's ``tools``: a list of objects, each with a
    ``function`` holding a ``name`` (None when empty)."""
    if not text:
        return None
    try:
        tools = json.loads(text)
    except ValueError as exc:
        raise InvalidInput(f"tools_json is not valid JSON ({exc})", "BAD_TOOLS") from None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise InvalidInput('tools_json must be a JSON array of {"type": "function", '
                           '"function": {"name": ..., "parameters": {...}}}', "BAD_TOOLS")
    return tools or None


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
