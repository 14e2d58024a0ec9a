"""The allowed values of the sampling parameters: one rule set for scheduler and workers.

The scheduler checks a client's request with it (after defaults), so a bad value is a
clear INVALID_ARGUMENT before anything is allocated; every worker checks the NewRequest of
a step with it too, so a step that would fail inside the sampler (top_logprobs over the
vocabulary, a zero repetition penalty) is refused before the step's commit point. Ranges
are those of OpenAI's API and vLLM: penalties in [-2, 2], repetition_penalty > 0, min_p
in [0, 1], at most 20 top logprobs.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Protocol

from tandem.errors import InvalidInput

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
PENALTY_LIMIT = 2.0  # presence and frequency penalties lie in [-PENALTY_LIMIT, PENALTY_LIMIT]
BAD_SAMPLING = "BAD_SAMPLING"


class SamplingValues(Protocol):
    """The resolved parameters the rules read (both services' sampling types have them)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def logprobs(self) -> bool: ...
    @property
    def top_logprobs(self) -> int: ...
    @property
    def stop_token_ids(self) -> Collection[int]: ...


def check_sampling(p: SamplingValues, vocab_size: int) -> None:
    """Raise InvalidInput (reason BAD_SAMPLING) naming the first value out of its range.

    Each comparison is written so that NaN fails it. ``top_k`` is not here: any value
    <= 0 disables it once resolved, and the public message's rule (>= -1) is the
    scheduler's.
    """
    if not p.temperature >= 0:
        _bad(f"temperature must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        _bad(f"top_p must be in (0, 1], got {p.top_p}")
    if not 0 <= p.min_p <= 1:
        _bad(f"min_p must be in [0, 1], got {p.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
            _bad(f"{name} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {value}")
    if not (p.repetition_penalty > 0 and math.isfinite(p.repetition_penalty)):
        _bad(f"repetition_penalty must be > 0 (1 disables it), got {p.repetition_penalty}")
    if not 0 <= p.top_logprobs <= min(MAX_TOP_LOGPROBS, vocab_size):
        _bad(f"top_logprobs must be in 0..{min(MAX_TOP_LOGPROBS, vocab_size)}, "
             f"got {p.top_logprobs}")
    if p.top_logprobs and not p.logprobs:
        _bad("top_logprobs needs logprobs set")
    bad_stop = sorted(t for t in p.stop_token_ids if not 0 <= t < vocab_size)
    if bad_stop:
        _bad(f"stop_token_ids {bad_stop} are outside the vocabulary of {vocab_size}")


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    if min_tokens > max_tokens:
        _bad(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})")


def check_stop_strings(stop: Sequence[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        _bad(f"{len(stop)} stop strings; the limit is {MAX_STOP_STRINGS}")
    for i, s in enumerate(stop):
        if not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
            _bad(f"stop string {i} is {len(s)} characters; each must be 1.."
                 f"{MAX_STOP_STRING_CHARS}")


def _bad(message: str) -> None:
    raise InvalidInput(message, BAD_SAMPLING)
