"""Chat templates: a conversation becomes prompt text through the model's own Jinja template.

The output must equal transformers' ``apply_chat_template(messages,
add_generation_prompt=True, tokenize=False)`` for the same files, so the environment has
the same shape (facts from transformers 5; the code is ours): an *immutable sandboxed*
Jinja environment (templates are untrusted code from a model hub) with ``trim_blocks``,
``lstrip_blocks`` and the ``loopcontrols`` extension; a ``{% generation %}`` block tag
that renders its body (training templates mark assistant text with it); ``tojson`` as
plain ``json.dumps`` (no HTML escaping, ``ensure_ascii=False``, with ``indent``,
``separators`` and ``sort_keys``); globals ``raise_exception(msg)`` and
``strftime_now(fmt)``; a ``namespace`` that refuses underscore names; and as variables
``messages``, ``tools`` (the request's, as OpenAI's ``tools`` list, else ``None``),
``documents`` (``None``), ``add_generation_prompt`` and the
tokenizer's named tokens (``bos_token``, ``eos_token``..., each ``*_token`` key of
``tokenizer_config.json``).

Where the template lives, first found wins: ``chat_template.jinja``, then
``chat_template.json`` (``{"chat_template": ...}``, the processor's file in older VLM
checkpoints), then ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of
``{"name", "template"}`` of which ``default`` is used).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from tandem.errors import InvalidInput
from tandem.text.model_files import BAD_MODEL, bad_key, read_json

TEMPLATE_FILE = "chat_template.jinja"
LEGACY_TEMPLATE_FILE = "chat_template.json"
BAD_CHAT = "BAD_CHAT"


@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True)
class ImagePart:
    """One image, in order: the n-th ImagePart of a conversation is the request's n-th image."""


ContentPart = TextPart | ImagePart


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call of an earlier assistant turn; ``arguments`` is the object its JSON
    text encodes (templates such as Qwen2.5's write ``arguments | tojson``, so the text
    itself would come out quoted)."""

    id: str
    name: str
    arguments: Any


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: tuple[ContentPart, ...]
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""  # a "tool" turn: the call it answers


def template_data(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages in the form chat templates read.

    Text-only content is one string (text-only templates such as Llama's and SmolLM2's
    print ``message['content']`` as is); content with an image is a list of
    ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` parts, the form VLM
    templates iterate. Multimodal templates render a list of text parts as their
    concatenation, so the two forms agree where both apply. Tool calls and a tool turn's
    ``tool_call_id`` are added as OpenAI's messages carry them.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        content: str | list[dict[str, str]]
        if all(isinstance(p, TextPart) for p in m.content):
            content = "".join(p.text for p in m.content if isinstance(p, TextPart))
        else:
            content = [{"type": "text", "text": p.text} if isinstance(p, TextPart)
                       else {"type": "image"} for p in m.content]
        data: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_calls:
            data["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}}
                                  for c in m.tool_calls]
        if m.tool_call_id:
            data["tool_call_id"] = m.tool_call_id
        out.append(data)
    return out


class ChatTemplate:
    """A compiled template plus the token variables it is rendered with."""

    def __init__(self, source: str, token_vars: Mapping[str, str], origin: str) -> None:
        self.origin = origin  # where the template came from, for error messages
        self.source = source  # read to tell the model's tool-call format
        self._vars = dict(token_vars)
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidInput(f"{origin}: chat template does not parse: {exc.message} "
                               f"(template line {exc.lineno})", BAD_MODEL) from exc

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text; a conversation the template refuses is :class:`InvalidInput`.
        ``tools``: OpenAI's ``tools`` list as the client sent it (None: no tools)."""
        if not messages:
            raise InvalidInput("the conversation has no messages", BAD_CHAT)
        try:
            return self._template.render(
                **self._vars, messages=template_data(messages),
                tools=list(tools) if tools else None, documents=None,
                add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as exc:
            # raise_exception() messages are written by the template's authors for users.
            raise InvalidInput(f"the model's chat template refused the conversation: {exc}",
                               BAD_CHAT) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise InvalidInput(
                f"the model's chat template failed on this conversation ({type(exc).__name__}: "
                f"{exc})", BAD_CHAT) from exc


def load_chat_template(model_dir: Path, tokenizer_config: Mapping[str, Any],
                       token_vars: Mapping[str, str]) -> ChatTemplate | None:
    """The model's template (see the module docstring for where it is looked up), or None."""
    jinja_file = model_dir / TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            return ChatTemplate(jinja_file.read_text(encoding="utf-8"), token_vars,
                                str(jinja_file))
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidInput(f"{jinja_file}: unreadable ({exc})", BAD_MODEL) from exc
    legacy_file = model_dir / LEGACY_TEMPLATE_FILE
    legacy = read_json(legacy_file, required=False)
    if legacy is not None:
        source = legacy.get("chat_template")
        if not isinstance(source, str):
            raise bad_key(legacy_file, "chat_template", "must be a string")
        return ChatTemplate(source, token_vars, str(legacy_file))
    config_file = model_dir / "tokenizer_config.json"
    source = tokenizer_config.get("chat_template")
    if source is None:
        return None
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            raise bad_key(config_file, "chat_template",
                          f"lists templates {sorted(map(str, named))} but none named 'default'")
        source = named["default"]
    if not isinstance(source, str):
        raise bad_key(config_file, "chat_template", "must be a string or a list of templates")
    return ChatTemplate(source, token_vars, f"{config_file} chat_template")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace()`` without underscore attributes (no reach into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may not set underscore attributes on a namespace ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


_ENV = _environment()
