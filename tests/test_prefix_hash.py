"""Prefix-cache block hashes: chaining, multimodal extra keys, salt, incremental use."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.prefix_hash import (
    ROOT_HASH,
    block_extra_keys,
    hash_block_tokens,
    request_block_hashes,
)
from tandem.features import MultiModalFeatureSpec, PlaceholderRange
from tandem.text.byte_tokenizer import IMAGE_ID


def _feature(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(identifier, "image", PlaceholderRange(offset, length), None)


def test_hash_is_a_pinned_sha256_independent_of_the_process() -> None:
    # A golden value: Python's hash() randomisation or dict order cannot reach it, and any
    # change of the encoding must also change HASH_SEED (and this value).
    h = hash_block_tokens(None, [1, 2, 3], (("img", -2), "salt"))
    assert len(h) == 32
    assert h.hex() == "29894008ce65225c2224190cecc9feb8f73d819baa479e1faca26d3e9dc0de3c"
    assert hash_block_tokens(None, [1, 2, 3], (("img", -2), "salt")) == h


def test_parent_tokens_and_keys_all_change_the_hash() -> None:
    base = hash_block_tokens(None, [1, 2, 3, 4], None)
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], None) == base  # None means the root
    variants = [
        hash_block_tokens(base, [1, 2, 3, 4], None),
        hash_block_tokens(None, [1, 2, 3, 5], None),
        hash_block_tokens(None, [1, 2, 3], None),
        hash_block_tokens(None, [1, 2, 3, 4], (("a", 0),)),
        hash_block_tokens(None, [1, 2, 3, 4], (("a", 1),)),
        hash_block_tokens(None, [1, 2, 3, 4], (("b", 0),)),
        hash_block_tokens(None, [1, 2, 3, 4], ("a", 0)),
        hash_block_tokens(None, [1, 2, 3, 4], ("a0",)),
        hash_block_tokens(None, [1, 2, 3, 4], ()),
    ]
    assert len({base, *variants}) == 1 + len(variants)


def test_extra_keys_relative_offsets() -> None:
    # vLLM test_generate_block_hash_extra_keys: items at (0, 5) and (10, 5).
    features = [_feature("hash1", 0, 5), _feature("hash2", 10, 5)]
    assert block_extra_keys(features, 0, 5, None, True) == (("hash1", 0),)
    assert block_extra_keys(features, 3, 8, None, False) == (("hash1", -3),)
    assert block_extra_keys(features, 6, 10, None, False) is None
    assert block_extra_keys(features, 0, 15, None, True) == (("hash1", 0), ("hash2", 10))
    assert block_extra_keys([], 0, 5, None, True) is None


def test_salt_only_on_the_first_block() -> None:
    features = [_feature("img", 2, 4)]
    assert block_extra_keys(features, 0, 4, "tenant", True) == (("img", 2), "tenant")
    assert block_extra_keys(features, 4, 8, "tenant", False) == (("img", -2),)
    assert block_extra_keys([], 0, 4, "tenant", True) == ("tenant",)
    assert block_extra_keys([], 0, 4, "", True) is None, "empty salt means no salt"

    tokens = list(range(12))
    plain = request_block_hashes(tokens, [], 4, None)
    salted = request_block_hashes(tokens, [], 4, "tenant")
    assert request_block_hashes(tokens, [], 4, "") == plain
    assert request_block_hashes(tokens, [], 4, "tenant") == salted
    # The chain carries the salt: every block differs, not just the first.
    assert all(a != b for a, b in zip(plain, salted, strict=True))


def _mm_prompt() -> tuple[list[int], list[MultiModalFeatureSpec]]:
    """vLLM test_mm_prefix_caching: block size 16, images at (11,10), (30,18), (48,7)."""
    tokens = [1] * 11 + [IMAGE_ID] * 10 + [2] * 9 + [IMAGE_ID] * 18 + [IMAGE_ID] * 7 + [3] * 4
    features = [_feature("aaa", 11, 10), _feature("bbb", 30, 18), _feature("ccc", 48, 7)]
    return tokens, features


def test_mm_block_hashes_and_output_tokens_completing_a_block() -> None:
    tokens, features = _mm_prompt()
    assert len(tokens) == 59
    hashes = request_block_hashes(tokens, features, 16, None)
    expected_keys = [(("aaa", 11),), (("aaa", -5), ("bbb", 14)), (("bbb", -2),)]
    parent = None
    for i, keys in enumerate(expected_keys):
        assert block_extra_keys(features, 16 * i, 16 * i + 16, None, i == 0) == keys
        parent = hash_block_tokens(parent, tokens[16 * i : 16 * i + 16], keys)
        assert hashes[i] == parent
    assert len(hashes) == 3, "the partial fourth block is not hashed"

    tokens += [7] * 5  # five output tokens complete the fourth block
    more = request_block_hashes(tokens, features, 16, None, known=hashes)
    assert more == [hash_block_tokens(hashes[2], tokens[48:64], (("ccc", 0),))]
    assert request_block_hashes(tokens, features, 16, None, known=hashes + more) == []


def test_same_image_at_another_offset_or_another_image_hashes_differently() -> None:
    tokens = [1] * 4 + [IMAGE_ID] * 12
    here = request_block_hashes(tokens, [_feature("x", 4, 8)], 16, None)
    shifted = request_block_hashes(tokens, [_feature("x", 5, 8)], 16, None)
    other = request_block_hashes(tokens, [_feature("y", 4, 8)], 16, None)
    assert len({here[0], shifted[0], other[0]}) == 3


@st.composite
def _requests(draw: st.DrawFn) -> tuple[list[int], list[MultiModalFeatureSpec], int, int]:
    n = draw(st.integers(0, 80))
    tokens = draw(st.lists(st.integers(0, 300), min_size=n, max_size=n))
    features, pos = [], 0
    for i in range(draw(st.integers(0, 3))):
        offset = pos + draw(st.integers(0, 10))
        length = draw(st.integers(1, 20))
        features.append(_feature(f"img{i}", offset, length))
        pos = offset + length
    return tokens, features, draw(st.integers(1, 9)), draw(st.integers(0, n))


@settings(max_examples=60, deadline=None)
@given(_requests(), st.sampled_from([None, "s"]))
def test_incremental_hashing_equals_hashing_at_once(
    req: tuple[list[int], list[MultiModalFeatureSpec], int, int], salt: str | None
) -> None:
    tokens, features, block_size, split = req
    whole = request_block_hashes(tokens, features, block_size, salt)
    assert len(whole) == len(tokens) // block_size
    first = request_block_hashes(tokens[:split], features, block_size, salt)
    assert first + request_block_hashes(tokens, features, block_size, salt, known=first) == whole
