"""The routing key of a request: what decides which cell it goes to.

A cell's caches pay off when requests that share cached work land on it: the processed
image (processor cache, keyed by the image's identity and the salt) and the KV prefix
(prefix cache, chained from the first block and the salt). So the key is the salt plus
the first image's identity, or, for a text-only request, the salt plus the first
``block_size`` bytes of its text.

Why bytes, not tokens: the picker serves any model and holds no tokenizer. Every token
of a byte-level or byte-fallback vocabulary stands for at least one byte of text, so two
prompts that share their first KV block (``block_size`` tokens) share at least their first
``block_size`` bytes: the key keeps requests that share a cached block together. (Prompts
that share fewer bytes may still meet on one cell; that costs nothing but balance.) A chat
request's text is its messages' roles and text parts in order, which the model's chat
template renders in that order.

The key only has to be stable across processes and equal for requests that share cache
entries; it need not equal the scheduler's mm hash (the picker does not import the
scheduler). sha256 over length-prefixed parts keeps two different part lists apart.
"""

from __future__ import annotations

import hashlib
from typing import NewType

from tandem.v1 import generate_pb2

RoutingKey = NewType("RoutingKey", bytes)

# Bump when the encoding changes (keys only need to agree among the pickers of one
# deployment, but a versioned root makes any change explicit).
KEY_VERSION = b"tandem.routing-key.v1"


def routing_key(request: generate_pb2.GenerateRequest, block_size: int) -> RoutingKey:
    """sha256 of (version, salt, first image's identity | first block of text)."""
    salt = request.cache_salt.encode()
    images = [*request.images, *(part.image for m in request.messages for part in m.content
                                 if part.HasField("image"))]
    if images:
        return _digest(salt, *image_identity(images[0]))
    return _digest(salt, b"text", first_block(request, block_size))


def image_identity(item: generate_pb2.MediaItem) -> tuple[bytes, ...]:
    """The parts that name an image as the processor cache does.

    A client-chosen uuid replaces the content as the cache key, so it does here too; a
    tensor is named by its dtype and shape as well as its bytes, since equal bytes can be
    different images.
    """
    if item.HasField("uuid"):
        return b"uuid", item.uuid.encode()
    if item.HasField("tensor"):
        t = item.tensor
        return b"tensor", t.dtype.encode(), repr(tuple(t.shape)).encode(), t.data
    return b"encoded", item.encoded


def first_block(request: generate_pb2.GenerateRequest, block_size: int) -> bytes:
    """The first ``block_size`` bytes of the request's text (all of it when shorter, so that
    the key is still stable); for a prompt given as token ids, its first block of ids."""
    if request.prompt_token_ids:
        return b"ids\0" + b"".join(t.to_bytes(4, "little")
                                   for t in request.prompt_token_ids[:block_size])
    if not request.messages:
        return request.prompt.encode()[:block_size]
    text = bytearray()
    for message in request.messages:
        text += message.role.encode() + b"\0"
        for part in message.content:
            text += part.text.encode()
            if len(text) >= block_size:
                return bytes(text[:block_size])
    return bytes(text)


def _digest(*parts: bytes) -> RoutingKey:
    h = hashlib.sha256(KEY_VERSION)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return RoutingKey(h.digest())
