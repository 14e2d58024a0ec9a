"""Stop strings in the streamed text (``scheduler_svc.output_text``): found across token
boundaries and inside one token, cut before (or after) the match, nothing past it ever
streamed, held-back text released when it turns out not to be a stop, min_tokens."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.output_text import OutputText
from tandem.text import ByteTokenizer, Tokenizer, load_tokenizer
from tandem_testing.text_checkpoints import qwen2_vl_dir

BYTES = ByteTokenizer()


@functools.cache
def _qwen() -> Tokenizer:
    return load_tokenizer(qwen2_vl_dir())


def _stream(tok: Tokenizer, ids: Sequence[int], stop: Sequence[str], include: bool = False,
            min_tokens: int = 0) -> tuple[list[str], int, bool]:
    """Feeds ``ids`` one step at a time: the texts streamed per step (the finish's last),
    the tokens kept and whether a stop string ended it."""
    out = OutputText(tok.incremental_decoder(), stop, include, min_tokens)
    texts, kept = [], 0
    for token in ids:
        delta = out.feed([token], kept)
        texts.append(delta.text)
        kept += delta.kept
        if delta.stopped:
            return texts, kept, True
    texts.append(out.finish())
    return texts, kept, False


def _ids(text: str) -> list[int]:
    return BYTES.encode(text, add_special_tokens=False)


def test_a_stop_string_across_byte_tokens_is_cut() -> None:
    ids = _ids("Hello END of it")
    texts, kept, stopped = _stream(BYTES, ids, ["END"])
    assert stopped and kept == len("Hello END") and "".join(texts) == "Hello "
    texts, kept, stopped = _stream(BYTES, ids, ["END"], include=True)
    assert stopped and kept == len("Hello END") and "".join(texts) == "Hello END"


def test_the_start_of_a_stop_string_is_held_back() -> None:
    texts, _, stopped = _stream(BYTES, _ids("aENxENDz"), ["END"])
    assert stopped
    # The last len("END") - 1 characters always wait (they may start the stop string).
    assert texts == ["", "", "a", "E", "N", "x", ""]
    # Without a match the held-back tail goes out at the finish.
    texts, kept, stopped = _stream(BYTES, _ids("abEN"), ["END"])
    assert not stopped and kept == 4 and texts[-1] == "EN" and "".join(texts) == "abEN"


def test_the_first_stop_string_to_complete_wins() -> None:
    texts, kept, _ = _stream(BYTES, _ids("xabcdy"), ["abcd", "bc"])
    assert "".join(texts) == "xa" and kept == len("xabc")
    texts, kept, _ = _stream(BYTES, _ids("xabcdy"), ["cd", "abcd"], include=True)
    assert "".join(texts) == "xabcd" and kept == len("xabcd")  # both end at d: earliest start


def test_a_stop_string_inside_one_token_drops_the_rest_of_that_token() -> None:
    """The token that completes the stop also carries text after it; none is streamed."""
    tok = _qwen()
    ids = tok.encode("Hello world, and more", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert " world" in pieces, pieces  # one token holds the stop string and more
    at = pieces.index(" world")
    for include, want in [(False, "Hello "), (True, "Hello wor")]:
        texts, kept, stopped = _stream(tok, ids, ["wor"], include)
        assert stopped and kept == at + 1 and "".join(texts) == want
        assert all("ld" not in t for t in texts)


def test_stop_strings_wait_for_min_tokens() -> None:
    ids = _ids("ENDab END")
    # Completed by output 3: not > min_tokens 3, so not looked for; the second one is.
    texts, kept, stopped = _stream(BYTES, ids, ["END"], min_tokens=3)
    assert stopped and kept == len(ids) and "".join(texts) == "ENDab "
    texts, kept, _ = _stream(BYTES, ids, ["END"], min_tokens=2)
    assert kept == 3 and "".join(texts) == ""


def test_multi_byte_text_and_a_multi_character_stop() -> None:
    text = "naïve café — déjà vu, ok"
    texts, kept, stopped = _stream(BYTES, _ids(text), ["déjà"])
    assert stopped and "".join(texts) == "naïve café — "
    assert kept == len("naïve café — déjà".encode())


def _reference(text: str, stops: list[str], include: bool) -> tuple[str, int | None]:
    """One token per character: the first prefix that contains a stop string decides; the
    cut is at that prefix's earliest match."""
    for end in range(1, len(text) + 1):
        found = [(text[:end].find(s), s) for s in stops if s in text[:end]]
        if found:
            i, s = min(found, key=lambda f: f[0])
            return (text[:i + len(s)] if include else text[:i]), end
    return text, None


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab c", max_size=24),
       stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), min_size=1,
                      max_size=3),
       include=st.booleans())
def test_stream_equals_the_reference_and_never_runs_past_it(text: str, stops: list[str],
                                                            include: bool) -> None:
    want, end = _reference(text, stops, include)
    texts, kept, stopped = _stream(BYTES, _ids(text), stops, include)
    assert stopped == (end is not None)
    assert kept == (end if end is not None else len(text))
    streamed = ""
    for t in texts:
        streamed += t
        assert want.startswith(streamed)  # at every step: never past the final text
    assert streamed == want
