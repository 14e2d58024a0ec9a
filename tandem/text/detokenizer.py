"""Streaming detokenization: generated ids become text a step at a time.

The stream must never show a broken character, never lose text at the end, skip special
tokens, and concatenate to exactly ``decode(all_ids, skip_special_tokens=True)``, while
costing O(new tokens) per step (re-decoding the whole output each step would make a long
answer quadratic).

How (the window scheme vLLM and TGI use; the code is ours): the decoder keeps a short
window of ids, ``context + pending``::

    window:  | context (already shown) | pending (not shown yet)       |
    text:    |<-- shown -->|<---------- decode(window)[shown:] ------->|

Each step decodes the window with the tokenizer's own decode. If the text ends in
U+FFFD, the last character is (probably) still incomplete: show nothing and wait.
Otherwise show what follows the context's text, and keep only the last id as the next
step's context. One id of context is enough for the decoders of byte-level BPE (bytes
concatenate) and of SentencePiece-style BPE, whose only context effect is stripping the
first token's leading space. Special ids are dropped on entry, as a one-shot decode that
skips them would, so they neither cost nor show anything.

NOTE: output that stays invalid UTF-8 for ``MAX_PENDING`` ids in a row (noise from a
broken model, not text) is shown as it decodes then, so a pathological stream cannot
grow the window without bound; only there may the stream's replacement characters sit
differently from a one-shot decode's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
# Ids that may wait for a character to complete (a UTF-8 character is at most 4 bytes,
# so real text never needs more than 4; the rest is slack).
MAX_PENDING = 16


class IncrementalDecoder(Protocol):
    """What the servicer calls per step: ``feed`` the step's ids, ``flush`` at the end."""

    def feed(self, token_ids: Iterable[int]) -> str: ...

    def flush(self) -> str: ...


class StreamDecoder:
    """:class:`IncrementalDecoder` over any ``decode(ids) -> str`` (see the module docstring).

    ``decode`` must be the tokenizer's one-shot decode with special tokens skipped, and
    ``special_ids`` the ids it skips.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str],
                 special_ids: Collection[int]) -> None:
        self._decode = decode
        self._special = frozenset(special_ids)
        self._window: list[int] = []  # context + pending ids
        self._context = 0  # leading ids of the window already shown (0 or 1)
        self._shown = 0  # characters of decode(window) already returned (the context's)

    def feed(self, token_ids: Iterable[int]) -> str:
        self._window.extend(t for t in token_ids if t not in self._special)
        if len(self._window) == self._context:  # nothing new, or only special ids
            return ""
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT) and len(self._window) <= MAX_PENDING:
            return ""
        new = text[self._shown:]
        self._window = self._window[-1:]
        self._context = 1
        self._shown = len(self._decode(self._window))
        return new

    def flush(self) -> str:
        """Whatever is still pending (an unfinished character shows as U+FFFD)."""
        new = self._decode(self._window)[self._shown:] if self._window else ""
        self._window = []
        self._context = self._shown = 0
        return new
