"""Tool calling: which format a model writes its calls in, reading them out of its output
(whole or streamed), and the grammar that forces a call.

Two formats (vLLM's parser names):

* ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, possibly
  several, with text around them: Qwen2/2.5, Hermes 2/3 and most templates that mention
  ``<tool_call>``.
* ``llama3_json``: the whole output is ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``; several separated by ``;``): Llama 3.1-3.3's JSON tool calling.

:class:`ToolCallParser` reads either incrementally, one piece of output text at a time, and
gives content text and tool-call deltas as OpenAI streams them: a call's first delta has its
id and name, later ones fragments of its ``arguments``, which are the model's own text of the
arguments object. Reading a whole output is the same parser fed once, so a streamed and a
whole answer always agree. Text that starts like a call but is not one (no ``name``, not a
JSON object) is given back as content; whitespace next to calls is dropped.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

ParserKind = Literal["hermes", "llama3_json"]
PARSERS: tuple[ParserKind, ...] = ("hermes", "llama3_json")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_ARGUMENT_KEYS = ("arguments", "parameters")
_WS = " \t\r\n"
# What a forced call's JSON looks like: the separators transformers' templates write
# (``tojson``, json.dumps' defaults), no free whitespace for a weak model to pad with.
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def detect_parser(template_source: str) -> ParserKind | None:
    """The tool-call format a chat template teaches its model, or None if it takes no tools
    the server knows how to read: ``<tool_call>`` -> hermes; ``<|python_tag|>`` or a
    template that lists tools with their ``"parameters"`` -> llama3_json."""
    if HERMES_START in template_source:
        return "hermes"
    if PYTHON_TAG in template_source or ("tools" in template_source
                                         and '"parameters"' in template_source):
        return "llama3_json"
    return None


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class CallDelta:
    """One call's part of a step: ``id`` and ``name`` only in its first delta."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ParsedCall:
    """A call read out of an output."""

    id: str
    name: str
    arguments: str  # JSON text of an object, as the model wrote it


@dataclass(slots=True)
class Parsed:
    """What a piece of output text turned into."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def call(self, index: int) -> CallDelta:
        if not self.calls or self.calls[-1].index != index:
            self.calls.append(CallDelta(index))
        return self.calls[-1]


class _CallObject:
    """Scans one call's JSON object a character at a time: its ``name`` once complete, and
    the text of its arguments value as it comes. Strict at the object's top level (a stray
    character there means it is no call), lenient inside values (any text whose strings and
    brackets balance)."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments = ""  # the arguments value's text so far
        self.has_arguments = False
        self.done = False  # the object closed
        self.failed = False
        self._state = "open"  # open | key | in_key | colon | value_start | value | after
        self._key = ""
        self._text = ""  # the key being read, or the name's value
        self._kind = ""  # the value's: container | string | scalar
        self._depth = 0  # brackets open inside a container value
        self._string = self._escape = False  # inside a string (of a key or a value)

    def feed(self, c: str) -> None:
        state = self._state
        if state == "in_key":
            self._text += c
            if self._string_char(c):
                self._key, self._text, self._state = json.loads(self._text), "", "colon"
        elif state == "value":
            self._value(c)
        elif c in _WS:
            return
        elif state == "open":
            self._expect(c == "{", "key")
        elif state == "key" and c == "}" and not self._key:  # {}
            self.done = True
        elif state == "key":
            self._expect(c == '"', "in_key")
            self._text, self._string = c, True
        elif state == "colon":
            self._expect(c == ":", "value_start")
        elif state == "value_start":
            self._kind = ("container" if c in "{[" else "string" if c == '"' else "scalar")
            self._state = "value"
            self._value(c)
        elif c == "}":  # after a value
            self.done = True
        else:
            self._expect(c == ",", "key")

    def _expect(self, ok: bool, then: str) -> None:
        self._state = then
        self.failed = self.failed or not ok

    def _string_char(self, c: str) -> bool:
        """Track a string's escapes; True when ``c`` closes it."""
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            self._string = False
            return True
        return False

    def _value(self, c: str) -> None:
        if self._kind == "scalar" and (c in _WS or c in ",}"):
            self._end_value()
            self.feed(c)
            return
        if self._key in _ARGUMENT_KEYS:
            self.has_arguments = True
            self.arguments += c
        elif self._key == "name":
            self._text += c
        if self._kind == "scalar":
            return
        if self._string:
            closed = self._string_char(c)
            if closed and self._kind == "string":
                self._end_value()
        elif c == '"':
            self._string = True
            if self._kind == "string":  # the opening quote
                return
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._end_value()

    def _end_value(self) -> None:
        if self._key == "name":
            try:
                name = json.loads(self._text)
            except ValueError:
                name = None
            if isinstance(name, str) and name:
                self.name = name
            else:
                self.failed = True
        self._state, self._text, self._key, self._kind = "after", "", "", ""


class ToolCallParser:
    """Reads one output's tool calls; :meth:`feed` each piece of text, then :meth:`finish`.
    :attr:`calls` holds every call so far, with its arguments as far as they came."""

    def __init__(self, kind: ParserKind) -> None:
        self._kind = kind
        # text | start (llama3_json: before the first character decides) | call |
        # between (a call closed: its end marker or separator) | after (hermes: past it)
        self._state = "start" if kind == "llama3_json" else "text"
        self._pending = ""  # text held back: a marker's beginning, or whitespace
        self._raw = ""  # the current call's text: content after all if it is no call
        self._call: _CallObject | None = None
        self._sent = 0  # characters of the call's arguments already given out
        self.calls: list[ParsedCall] = []

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        for c in text:
            self._char(c, out)
        if self._state == "text":
            keep = _held(self._pending, self._kind)
            out.content += self._pending[:len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep:]
        return out

    def finish(self) -> Parsed:
        """The end of the output: what was held back. A call cut short (``max_tokens``)
        stays a call, its arguments as far as they came."""
        out = Parsed()
        if self._state == "call" and self._call is not None and self._call.name is None:
            out.content += self._raw
        elif self._state in ("text", "start"):
            out.content += self._pending.rstrip(_WS) if self.calls else self._pending
        self._state, self._pending = "done", ""
        return out

    def _char(self, c: str, out: Parsed) -> None:
        if self._state == "text":
            self._pending += c
            if self._kind == "hermes" and self._pending.endswith(HERMES_START):
                out.content += self._pending[:-len(HERMES_START)].rstrip(_WS)
                self._start_call(HERMES_START)
        elif self._state == "call":
            self._call_char(c, out)
        elif self._state == "start":
            self._pending += c
            rest = self._pending.lstrip(_WS)
            rest = rest[len(PYTHON_TAG):].lstrip(_WS) if rest.startswith(PYTHON_TAG) else rest
            if not rest or PYTHON_TAG.startswith(rest):
                return
            if rest[0] == "{":
                self._start_call(self._pending[:-1])
                self._call_char(c, out)
            else:
                self._state = "text"
        elif self._state == "between":
            self._between(c, out)
        elif self._state == "after" and c not in _WS:
            self._state = "text"
            self._char(c, out)

    def _between(self, c: str, out: Parsed) -> None:
        self._pending += c
        rest = self._pending.lstrip(_WS)
        if self._kind == "hermes":
            if rest == HERMES_END:
                self._state, self._pending = "after", ""
            if HERMES_END.startswith(rest):
                return
        else:
            after = rest[1:].lstrip(_WS)
            if rest in ("", ";") or (rest.startswith(";") and not after):
                return
            if rest.startswith(";") and after == "{":
                self._start_call("")
                self._call_char(c, out)
                return
        self._state, self._pending = "text", ""
        for ch in rest:
            self._char(ch, out)

    def _start_call(self, raw: str) -> None:
        self._state, self._call, self._raw, self._pending, self._sent = (
            "call", _CallObject(), raw, "", 0)

    def _call_char(self, c: str, out: Parsed) -> None:
        call = self._call
        assert call is not None  # the state is "call"
        self._raw += c
        announced = call.name is not None
        call.feed(c)
        if call.failed:
            self._call = None
            self._state = "text"
            if not announced:  # no call after all: its text is content
                out.content += self._raw
            return
        if not announced and call.name is not None:
            self.calls.append(ParsedCall(new_call_id(), call.name, ""))
            delta = out.call(len(self.calls) - 1)
            delta.id, delta.name = self.calls[-1].id, call.name
        if call.name is not None and len(call.arguments) > self._sent:
            self._give(call.arguments[self._sent:], out)
        if not call.done:
            return
        self._call, self._state = None, "between"
        if call.name is None:  # a JSON object, but no call: content
            out.content += self._raw
            self._state = "text"
        elif not call.has_arguments:
            self._give("{}", out)

    def _give(self, arguments: str, out: Parsed) -> None:
        out.call(len(self.calls) - 1).arguments += arguments
        self.calls[-1].arguments += arguments
        self._sent += len(arguments)


def _held(text: str, kind: ParserKind) -> int:
    """How many characters at the end of ``text`` to keep back: its trailing whitespace
    (dropped if a call follows) and, for hermes, an end that may begin ``<tool_call>``."""
    marker = 0
    if kind == "hermes":
        marker = next((n for n in range(min(len(HERMES_START) - 1, len(text)), 0, -1)
                       if HERMES_START.startswith(text[-n:])), 0)
    before = text[:len(text) - marker]
    return marker + len(before) - len(before.rstrip(_WS))


def parse_whole(kind: ParserKind, text: str) -> tuple[str | None, list[ParsedCall]]:
    """A whole output's content (None when empty) and tool calls."""
    parser = ToolCallParser(kind)
    content = parser.feed(text).content + parser.finish().content
    return content or None, parser.calls


# --- forcing a call ------------------------------------------------------------------------

def call_grammar(kind: ParserKind, tools: Sequence[Mapping[str, Any]], several: bool) -> str:
    """A Lark grammar (llguidance's dialect) for a call of one of ``tools`` in the model's
    own format, its arguments valid under the function's ``parameters`` schema; ``several``:
    one or more calls."""
    options = [_call_schema(kind, t["function"]) for t in tools]
    schema = dict(options[0]) if len(options) == 1 else {"anyOf": options}
    schema["x-guidance"] = _COMPACT_JSON
    body = "%json " + json.dumps(schema)
    if kind == "hermes":
        call, sep = f'"{HERMES_START}\\n" body "\\n{HERMES_END}"', '"\\n"'
    else:
        call, sep = "body", '"; "'
    start = f"start: call ({sep} call)*" if several else "start: call"
    return f"{start}\ncall: {call}\nbody: {body}\n"


def _call_schema(kind: ParserKind, function: Mapping[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    if params is None or params == {}:
        params = {"type": "object"}
    key = "arguments" if kind == "hermes" else "parameters"
    return {"type": "object", "properties": {"name": {"const": function["name"]}, key: params},
            "required": ["name", key], "additionalProperties": False}

