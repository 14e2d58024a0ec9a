"""Byte-level tokenizer shared by the scheduler (encode, decode) and the model (vocabulary).

Token ids 0..255 are the UTF-8 bytes themselves; the special tokens follow. The literal
text ``<image>`` in a prompt is not tokenized as bytes: it becomes one IMAGE placeholder,
which the scheduler then expands to the image's embedding count.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

NUM_BYTE_TOKENS = 256
PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
IMAGE_ID = 259
VOCAB_SIZE = 260
IMAGE_MARKER = "<image>"


def encode(prompt: str) -> list[int]:
    """BOS, then the prompt's UTF-8 bytes, with one IMAGE_ID per ``<image>`` marker."""
    ids = [BOS_ID]
    for i, piece in enumerate(prompt.split(IMAGE_MARKER)):
        if i:
            ids.append(IMAGE_ID)
        ids.extend(piece.encode("utf-8"))
    return ids


def count_image_markers(prompt: str) -> int:
    return prompt.count(IMAGE_MARKER)


@dataclass
class IncrementalDecoder:
    """Turns a stream of generated ids into text without splitting UTF-8 sequences.

    Bytes of an incomplete multi-byte character are held back until the rest arrives;
    special tokens produce no text.
    """

    _pending: bytearray = field(default_factory=bytearray)

    def feed(self, token_ids: Iterable[int]) -> str:
        self._pending.extend(t for t in token_ids if t < NUM_BYTE_TOKENS)
        keep = _incomplete_tail(self._pending)
        text = bytes(self._pending[: len(self._pending) - keep]).decode("utf-8", "replace")
        del self._pending[: len(self._pending) - keep]
        return text

    def flush(self) -> str:
        """Text for whatever is still pending (an incomplete sequence becomes U+FFFD)."""
        text = bytes(self._pending).decode("utf-8", "replace")
        self._pending.clear()
        return text


_LEADS = ((2, 0b110), (3, 0b1110), (4, 0b11110))  # (sequence length, lead-byte prefix)


def _incomplete_tail(buf: bytearray) -> int:
    """Length of a trailing, possibly valid but unfinished UTF-8 sequence (0..3)."""
    for back in range(1, min(4, len(buf)) + 1):
        b = buf[-back]
        if b & 0xC0 != 0x80:  # a lead byte (or ASCII)
            need = next((n for n, lead in _LEADS if b >> (7 - n) == lead), 1)
            return back if need > back else 0
    return 0
