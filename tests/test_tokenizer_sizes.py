"""The built-in models' byte tokenizer, its incremental UTF-8 decoding, and size parsing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.sizes import parse_size
from tandem.text import byte_tokenizer as tokenizer


def test_encode_marks_images_and_starts_with_bos() -> None:
    tok = tokenizer.ByteTokenizer()
    assert tok.encode("a<image>b") == [tokenizer.BOS_ID, 97, tokenizer.IMAGE_ID, 98]
    assert tok.encode("<image><image>x").count(tok.image.pad_id) == 2


@given(st.text(), st.integers(min_value=1, max_value=7))
def test_incremental_decoding_never_splits_characters(text: str, chunk: int) -> None:
    data = [*text.encode("utf-8"), tokenizer.EOS_ID]
    decoder = tokenizer.ByteTokenizer().incremental_decoder()
    pieces = [decoder.feed(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    assert "".join(pieces) + decoder.flush() == text
    assert all("\ufffd" not in p for p in pieces if "\ufffd" not in text)


def test_incomplete_tail_is_flushed_as_replacement() -> None:
    decoder = tokenizer.ByteTokenizer().incremental_decoder()
    assert decoder.feed([0xE2, 0x82]) == ""
    assert decoder.flush() == "\ufffd"


@pytest.mark.parametrize(("text", "value"), [
    ("4096", 4096), ("256Mi", 256 * 2**20), ("1Gi", 2**30), ("1.5K", 1500), (7, 7),
    ("16MiB", 16 * 2**20), ("2GiB", 2 * 2**30), ("1KiB", 1024), ("3MB", 3 * 10**6),
    ("1GB", 10**9), ("5kB", 5000), ("64B", 64),
])
def test_parse_size(text: str | int, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "12Q", "-1Mi", "Mi", "16MiX", "1Mb"])
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)
