"""Prefix-cache block hashes: one sha256 per full KV block, chained from the previous block.

A block's hash fingerprints the whole prefix up to its last token: it covers the parent
block's hash, the block's token ids, and *extra keys* for what the token ids do not show:

* each multimodal item overlapping the block, as ``(identifier, offset - block_start)``.
  Image placeholder tokens are the same for every image, so the item's identity (its mm
  hash) must be in the key; the offset within the block keeps identical placeholder
  blocks apart when the same image sits at different positions;
* the request's ``cache_salt``, on the first block only: the chain carries it onward, and
  tenants with different salts never share a block.

Hashes use sha256 over a canonical, tagged byte encoding (never Python's ``hash()``,
which is randomised per process), so they are stable across processes and restarts.
The chain's root is derived from :data:`HASH_SEED`, an explicit constant logged by the
KV-cache manager; changing the encoding means changing the seed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, NewType

if TYPE_CHECKING:
    from tandem.features import MultiModalFeatureSpec

BlockHash = NewType("BlockHash", bytes)

# The root of every chain. Versioned: bump it whenever the encoding below changes, so hashes
# computed under different encodings can never be mistaken for each other.
HASH_SEED = b"tandem.prefix-hash.v1"
ROOT_HASH = BlockHash(hashlib.sha256(HASH_SEED).digest())

# One extra key: an mm item ``(identifier, relative offset)`` or the salt string.
ExtraKey = tuple[str, int] | str


def hash_block_tokens(
    parent: BlockHash | None, tokens: Sequence[int], extra_keys: tuple[ExtraKey, ...] | None
) -> BlockHash:
    """The hash of one block given its parent's hash (None for the first block).

    Encoding: parent digest (32 bytes), token count and ids as little-endian uint32, then
    the tagged extra keys. Every part has a fixed width or a length prefix, so two
    different inputs never encode to the same bytes.
    """
    h = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    h.update(struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens))
    out = bytearray()
    _encode_key(extra_keys, out)
    h.update(out)
    return BlockHash(h.digest())


def _encode_key(value: object, out: bytearray) -> None:
    """Appends a tagged encoding: ``n`` None, ``i`` int64, ``s`` utf-8 string, ``t`` tuple."""
    if value is None:
        out += b"n"
    elif isinstance(value, int):
        out += b"i" + struct.pack("<q", value)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += b"s" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, tuple):
        out += b"t" + struct.pack("<I", len(value))
        for item in value:
            _encode_key(item, out)
    else:
        raise TypeError(f"extra key of unsupported type {type(value).__name__}")


def block_extra_keys(
    features: Sequence[MultiModalFeatureSpec],
    start: int,
    end: int,
    cache_salt: str | None,
    is_first_block: bool,
) -> tuple[ExtraKey, ...] | None:
    """Extra keys of the block of tokens ``[start, end)``; None when there are none.

    Features must be sorted by offset (as a request holds them). An item overlaps the
    block when ``offset < end`` and ``offset + length > start``; its key carries
    ``offset - start``, negative when the item began in an earlier block. An empty salt
    means "no salt", as in the public API.
    """
    keys: list[ExtraKey] = []
    for f in features:
        offset, length = f.mm_position.offset, f.mm_position.length
        if offset >= end:
            break
        if offset + length > start:
            keys.append((f.identifier, offset - start))
    if cache_salt and is_first_block:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def request_block_hashes(
    token_ids: Sequence[int],
    features: Sequence[MultiModalFeatureSpec],
    block_size: int,
    cache_salt: str | None,
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` after the ``len(known)`` already hashed.

    Returns only the new hashes, chained from ``known[-1]``: a request keeps one list and
    extends it with this call whenever prompt or output tokens complete more blocks. A
    trailing partial block is never hashed (its tokens may still change the hash).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    assert all(a.mm_position.offset <= b.mm_position.offset for a, b in pairwise(features)), (
        "features must be sorted by mm_position.offset"
    )
    parent = known[-1] if known else None
    hashes: list[BlockHash] = []
    for index in range(len(known), len(token_ids) // block_size):
        start = index * block_size
        end = start + block_size
        keys = block_extra_keys(features, start, end, cache_salt, is_first_block=index == 0)
        parent = hash_block_tokens(parent, token_ids[start:end], keys)
        hashes.append(parent)
    return hashes
