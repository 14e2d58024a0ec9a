"""Streaming detokenization: no broken characters, nothing lost, specials skipped, the stream
equal to a one-shot decode, and O(new tokens) work per step."""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.text import ByteTokenizer, StreamDecoder, Tokenizer, load_tokenizer
from tandem.text.detokenizer import MAX_PENDING, REPLACEMENT
from tandem_testing.text_checkpoints import (
    llama3_style_dir,
    qwen2_vl_dir,
    reference_tokenizer,
    smollm2_dir,
)

MULTIBYTE = [
    "你好，世界！这是一个关于流式解码的测试。",  # noqa: RUF001 (CJK punctuation)
    "emoji 🤖🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 and a zero-width joiner‍ end",
    "Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย, 한국어.",
    "mixed: naïve café — “quotes” … ½ ∑ ∞ ≠ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",  # noqa: RUF001 (4-byte letters)
    "def 函数(x):\n    return x  # 注释 🐍\n",
]
DIRS = {"qwen2-vl": qwen2_vl_dir, "llama3-style": llama3_style_dir, "smollm2": smollm2_dir}


@functools.cache
def _qwen() -> Tokenizer:
    return load_tokenizer(qwen2_vl_dir())


def _stream(tok: Tokenizer, ids: Sequence[int], chunks: Sequence[int]) -> list[str]:
    decoder = tok.incremental_decoder()
    out, i = [], 0
    for n in chunks:
        out.append(decoder.feed(ids[i:i + n]))
        i += n
    out.append(decoder.feed(ids[i:]))
    out.append(decoder.flush())
    return out


@pytest.fixture(scope="module", params=sorted(DIRS))
def named(request) -> tuple[str, Tokenizer]:
    return request.param, load_tokenizer(DIRS[request.param]())


@pytest.fixture(scope="module")
def hf(named) -> Tokenizer:
    return named[1]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_one_id_at_a_time_equals_one_shot_and_never_breaks_a_character(hf, text) -> None:
    ids = hf.encode(text, add_special_tokens=False)
    pieces = _stream(hf, ids, [1] * len(ids))
    assert "".join(pieces) == hf.decode(ids) == text
    assert not any(REPLACEMENT in p for p in pieces)


def test_random_chunks_with_special_tokens_skipped(named) -> None:
    name, hf = named
    rng = random.Random(0)
    specials = sorted(hf._special_ids)  # type: ignore[attr-defined]
    ids: list[int] = []
    for text in MULTIBYTE:
        ids += [*hf.encode(text, add_special_tokens=False), rng.choice(specials)]
    for _ in range(20):
        chunks = [rng.randint(0, 5) for _ in range(len(ids))]
        assert "".join(_stream(hf, ids, chunks)) == hf.decode(ids)
    # ...and the one-shot decode is transformers' with special tokens skipped.
    assert hf.decode(ids) == reference_tokenizer(DIRS[name]()).decode(
        ids, skip_special_tokens=True)


def test_unfinished_character_at_the_end_is_not_lost(hf) -> None:
    """A stream cut inside a character shows it, as a one-shot decode does, at flush."""
    emoji = next(e for e in "🤖🐍🎉👍🧪𓀀🫠ꙮ🀄🦩" if len(hf.encode(e, add_special_tokens=False)) > 1)
    ids = hf.encode("ok " + emoji, add_special_tokens=False)[:-1]  # the last byte(s) missing
    assert hf.decode(ids).endswith(REPLACEMENT)
    pieces = _stream(hf, ids, [1] * len(ids))
    assert "".join(pieces) == hf.decode(ids) and pieces[-1].endswith(REPLACEMENT)
    assert not any(REPLACEMENT in p for p in pieces[:-1])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 151656), min_size=0, max_size=40),
       st.lists(st.integers(0, 4), min_size=0, max_size=40))
def test_any_id_stream_equals_one_shot(ids: list[int], chunks: list[int]) -> None:
    """Arbitrary ids, byte garbage included: the stream still equals the one-shot decode."""
    tok = _qwen()
    assert "".join(_stream(tok, ids, chunks)) == tok.decode(ids)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 259), max_size=60), st.lists(st.integers(0, 4), max_size=60))
def test_byte_tokenizer_stream_equals_one_shot(ids: list[int], chunks: list[int]) -> None:
    tok = ByteTokenizer()
    assert "".join(_stream(tok, ids, chunks)) == tok.decode(ids)


def test_byte_tokenizer_multibyte_text() -> None:
    tok = ByteTokenizer()
    for text in MULTIBYTE:
        ids = tok.encode(text)
        pieces = _stream(tok, ids, [1] * len(ids))
        assert "".join(pieces) == text and not any(REPLACEMENT in p for p in pieces)


def test_work_per_step_is_bounded_by_the_new_tokens() -> None:
    """Ids decoded in total stay a small multiple of the output, at any length."""
    tok = _qwen()
    ids = tok.encode("".join(MULTIBYTE) * 10, add_special_tokens=False)
    decoded = 0

    def counting_decode(window: Sequence[int]) -> str:
        nonlocal decoded
        decoded += len(window)
        return tok.decode(window)

    decoder = StreamDecoder(counting_decode, ())
    text = "".join(decoder.feed([t]) for t in ids) + decoder.flush()
    assert text == tok.decode(ids)
    assert decoded <= 4 * len(ids), (decoded, len(ids))


def test_invalid_utf8_cannot_grow_the_window_without_bound() -> None:
    tok = ByteTokenizer()
    decoder = tok.incremental_decoder()
    shown = "".join(decoder.feed([0x80]) for _ in range(10 * MAX_PENDING))  # lone continuations
    assert shown  # shown after MAX_PENDING ids at most, not held until the end
    assert len(decoder._window) <= MAX_PENDING + 1  # type: ignore[attr-defined]
    assert shown + decoder.flush() == tok.decode([0x80] * 10 * MAX_PENDING)
