"""A request's streamed text: decoded a step at a time, stop strings found and cut.

The scheduler owns this (not the servicer) because a stop string ends the request: its
blocks are freed at the step that completed the string, and the text the client has seen
must never run past it. One ``OutputText`` lives on the ``Request`` from its first output
to its last, so a preemption changes nothing (the tokens already sampled stay decoded).

How a stop string is cut (``include_stop_str_in_output`` false)::

    decoded:  ... shown text | held back (longest stop - 1 chars) | new text
                                       |<------ searched for every stop string ------>|
    found:    ... shown text | kept up to the match | STOP ..... (dropped, never sent)

While running, the last ``longest stop - 1`` characters are held back: they may be the
start of a stop string the next token completes, and once sent they cannot be taken back.
With ``include_stop_str_in_output`` nothing is held back (the stop string itself is sent)
and the text ends right after the match. A match counts only once the request has more
than ``min_tokens`` outputs (vLLM's rule), and only a match that ends in text decoded since
the previous look: earlier text was searched then. Tokens are fed one at a time, so the
token that completed a stop string is known and later tokens of the same step are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.text import IncrementalDecoder


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str  # to send now
    kept: int  # of the fed tokens, those that belong to the output (all, unless a stop cut)
    stopped: bool  # a stop string ended the output


class OutputText:
    """Incremental detokenization plus stop strings for one request.

    Invariants: ``_shown <= len(_text)``; what was returned is ``_text[:_shown]`` and is
    never shortened; once ``stopped`` nothing more is returned. Only this class mutates
    its fields.
    """

    def __init__(self, decoder: IncrementalDecoder, stop: Sequence[str] = (),
                 include_stop: bool = False, min_tokens: int = 0) -> None:
        self._decoder = decoder
        self._stop = tuple(stop)
        self._include = include_stop
        self._min_tokens = min_tokens
        self._hold = 0 if include_stop or not stop else max(map(len, stop)) - 1
        self._text = ""  # decoded so far (cut at the stop string once one matched)
        self._shown = 0  # characters of _text returned
        self.stopped = False

    def feed(self, token_ids: Sequence[int], outputs_before: int) -> TextDelta:
        """Text for ``token_ids``, the outputs after the first ``outputs_before``."""
        assert not self.stopped, "fed after a stop string ended the output"
        for i, token in enumerate(token_ids):
            start = len(self._text)
            self._text += self._decoder.feed([token])
            if self._stop and outputs_before + i + 1 > self._min_tokens:
                cut = self._match(start)
                if cut is not None:
                    self._text, self.stopped = self._text[:cut], True
                    return TextDelta(self._take(cut), i + 1, True)
        return TextDelta(self._take(max(self._shown, len(self._text) - self._hold)),
                         len(token_ids), False)

    def finish(self) -> str:
        """The rest, when the output ended for another reason (EOS, a stop id, length):
        held-back text and the decoder's unfinished bytes."""
        if self.stopped:
            return ""
        self._text += self._decoder.flush()
        return self._take(len(self._text))

    def _match(self, start: int) -> int | None:
        """End of the kept text for the earliest stop string that ends after ``start``."""
        best: tuple[int, int] | None = None  # (match index, kept end)
        for s in self._stop:
            i = self._text.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, i + len(s) if self._include else i)
        return None if best is None else best[1]

    def _take(self, end: int) -> str:
        text = self._text[self._shown:end]
        self._shown = max(self._shown, end)
        return text
