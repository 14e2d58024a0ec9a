"""Streaming detokenization: generated ids become text a step at a time.

The stream must never show a broken character, never lose text at the end, skip special
tokens, and concatenate to exactly ``decode(all_ids, skip_special_tokens=True)``, while
costing O(new tokens) per step (re-decoding the whole output each step would make a long
answer quadratic).

How (the window scheme vLLM and TGI use, made exact; the code is ours): the decoder
keeps a short window of ids, ``context + pending``::

    window:  | context (1 id, shown) | pending                                |
    text:    |<------- shown ------->|<-- decode(window)[shown:] ----------->|

Each step decodes the window with the tokenizer's own decode and shows the new text up to
any trailing U+FFFD (the bytes of an unfinished character: what follows may complete
it). When the window's text ends cleanly it restarts from its last id, kept as context:
one id is enough for the decoders of byte-level BPE (bytes concatenate) and of
SentencePiece-style BPE, whose only context effect is stripping the first token's
leading space. Byte-level BPE tokens may straddle characters, so a window can stay
unfinished for a while; past ``MAX_PENDING`` ids it restarts at its last token boundary
where the text ends cleanly. Special ids are dropped on entry, as a one-shot decode that
skips them would, so they neither cost nor show anything.

NOTE: a window of ``MAX_PENDING`` ids with no clean boundary at all is not text (invalid
UTF-8 from a broken model); it is shown as it decodes then, so such a stream cannot grow
the window without bound. Only there may its replacement characters sit differently
from a one-shot decode's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
# Pending ids before the window is cut back to a clean boundary (bounds the work per id).
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
        self._context = 0  # leading ids of the window kept only as context (0 or 1)
        self._shown = 0  # characters of decode(window) already returned

    def feed(self, token_ids: Iterable[int]) -> str:
        self._window.extend(t for t in token_ids if t not in self._special)
        if len(self._window) == self._context:  # nothing new, or only special ids
            return ""
        text = self._decode(self._window)
        if not text.endswith(REPLACEMENT):
            new = text[self._shown:]
            self._shown = len(text)
            self._restart(len(self._window), len(text))
            return new
        stable = max(self._shown, len(text.rstrip(REPLACEMENT)))
        new = text[self._shown:stable]
        self._shown = stable
        if len(self._window) > MAX_PENDING:
            new += self._cut(text)
        return new

    def flush(self) -> str:
        """Whatever is still pending (an unfinished character shows as U+FFFD)."""
        new = self._decode(self._window)[self._shown:] if self._window else ""
        self._window = []
        self._context = self._shown = 0
        return new

    def _cut(self, text: str) -> str:
        """Restart a long window at its last clean boundary; text past it stays shown."""
        for end in range(len(self._window) - 1, self._context, -1):
            head = self._decode(self._window[:end])
            if not head.endswith(REPLACEMENT):
                self._restart(end, len(head))
                return ""
        new = text[self._shown:]  # no boundary: not text (see the module docstring)
        self._shown = len(text)
        self._restart(len(self._window), len(text))
        return new

    def _restart(self, end: int, head_len: int) -> None:
        """Keep ``window[end - 1:]``; ``window[:end]`` decodes cleanly to ``head_len`` chars.

        The text after a clean boundary does not depend on what precedes it, so the new
        window has shown as many of those characters as the old one had.
        """
        shown_after = self._shown - head_len  # >= 0: a clean head is all shown
        self._window = self._window[end - 1:]
        self._context = 1
        self._shown = len(self._decode(self._window[:1])) + shown_after
