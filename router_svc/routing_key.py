"""The routing key of a request: what decides which cell it goes to.

A cell's caches pay off when requests that share cached work land on it: the processed
image (processor cache, keyed by the image's identity and the salt) and the KV prefix
(prefix cache, chained from the first block and the salt). So the key is the salt plus
the first image's identity, or, for a text-only request, the salt plus the first full
prompt block's tokens.

The key only has to be stable across processes and equal for requests that share cache
entries; it need not equal the scheduler's mm hash (the router does not import the
scheduler). sha256 over length-prefixed parts keeps two different part lists apart.
"""

from __future__ import annotations

import hashlib
from typing import NewType

from tandem.tokenizer import encode
from tandem.v1 import generate_pb2

RoutingKey = NewType("RoutingKey", bytes)

# Bump when the encoding changes (keys only need to agree among the routers of one
# deployment, but a versioned root makes any change explicit).
KEY_VERSION = b"tandem.routing-key.v1"


def routing_key(request: generate_pb2.GenerateRequest, block_size: int) -> RoutingKey:
    """sha256 of (version, salt, first image's identity | first prompt block's tokens)."""
    if request.images:
        return _digest(request.cache_salt.encode(), *image_identity(request.images[0]))
    return _digest(request.cache_salt.encode(), b"block", first_block(request.prompt, block_size))


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


def first_block(prompt: str, block_size: int) -> bytes:
    """The token ids of the prompt's first full KV block as little-endian uint32.

    A prompt shorter than one block has no cacheable prefix; its whole token list is used
    so that the key is still stable.
    """
    ids = encode(prompt)[:block_size]
    return b"".join(i.to_bytes(4, "little") for i in ids)


def _digest(*parts: bytes) -> RoutingKey:
    h = hashlib.sha256(KEY_VERSION)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return RoutingKey(h.digest())
