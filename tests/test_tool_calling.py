"""Tool calling on ``/v1/chat/completions`` (issue 25, item 2).

* The parsers on known outputs (hermes: Qwen2.5's ``<tool_call>`` JSON with text around it;
  llama3_json), whole and streamed split at every position: the same content and calls.
* Tools, assistant tool calls and tool results render as transformers renders them
  (Qwen2.5-Instruct's template), and the parser is told from the template.
* End to end with the real ``openai`` client against ``tandem serve --http-listen`` on a tiny
  random Qwen2 model with Qwen2.5's template and tool tokens (over a byte vocabulary, see
  tandem_testing/text_checkpoints.py): ``required`` and a named
  function yield parsed calls whose arguments satisfy the function's schema (the grammar
  guarantees it, whatever the weights), streamed as OpenAI streams them, ``finish_reason``
  ``tool_calls``; ``auto`` and ``none``; a conversation with calls and results; bad
  requests are 400 with the field at fault.
* ``parallel_tool_calls: false`` with ``auto``: of two calls the model wrote, the first is
  returned, whole and streamed.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from hf_checkpoints import reference, save

from tandem.openai_api import convert, schema
from tandem.openai_api.tool_calls import (
    PARSERS,
    ToolCallParser,
    call_grammar,
    detect_parser,
    parse_whole,
)
from tandem.structured import Constraint, GuidanceBackend
from tandem.text import ChatMessage, TextPart, ToolCall, load_tokenizer
from tandem.v1 import generate_pb2
from tandem_testing.cells import Cell, free_port, running_cell
from tandem_testing.text_checkpoints import qwen2_5_dir, reference_tokenizer

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 8},
    "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                  "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]

HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"unit": "c", "n": [1, {"k": "}\\""}]}}\n</tool_call>\n<tool_call>\n'
          '{"arguments": {}, "name": "get_time"}\n</tool_call>')
KNOWN = [
    ("hermes", HERMES, "Let me look.", [
        ("get_weather", '{"city": "Paris", "unit": "c", "n": [1, {"k": "}\\""}]}'),
        ("get_time", "{}")]),
    ("hermes", "No call <tool but a < sign", "No call <tool but a < sign", []),
    ("hermes", '<tool_call>\n{"no_name": 1}\n</tool_call>',
     '<tool_call>\n{"no_name": 1}\n</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1',  # cut short
     None, [("get_time", '{"zone": 1')]),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1.5e3, "y": true}}; '
                    '{"name": "g", "parameters": {}}', None,
     [("f", '{"x": 1.5e3, "y": true}'), ("g", "{}")]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"q": "a\\"b"}}', None,
     [("f", '{"q": "a\\"b"}')]),
    ("llama3_json", ' {"answer": 4}', ' {"answer": 4}', []),
    ("llama3_json", 'Hello {"name": "f"}', 'Hello {"name": "f"}', []),
]


def _streamed(kind: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Content, calls (name, arguments joined from the deltas) and ids, fed ``pieces``."""
    parser = ToolCallParser(kind)  # type: ignore[arg-type]
    content, calls, ids = "", {}, []
    for piece in [*pieces, None]:
        out = parser.feed(piece) if piece is not None else parser.finish()
        content += out.content
        for d in out.calls:
            if d.id is not None:
                assert d.index == len(calls) and d.name, "a call's first delta names it"
                calls[d.index], _ = [d.name, ""], ids.append(d.id)
            calls[d.index][1] += d.arguments
    return content, [tuple(c) for c in calls.values()], ids  # type: ignore[misc]


@pytest.mark.parametrize(("kind", "text", "content", "calls"), KNOWN)
def test_parsers_read_known_outputs_whole_and_split_anywhere(
        kind: str, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    whole_content, whole_calls = parse_whole(kind, text)  # type: ignore[arg-type]
    assert whole_content == content
    assert [(c.name, c.arguments) for c in whole_calls] == calls
    assert all(c.id.startswith("call_") for c in whole_calls)
    for cut in range(len(text) + 1):
        got = _streamed(kind, [text[:cut], text[cut:]])
        assert (got[0] or None, got[1]) == (content, calls), cut
    assert _streamed(kind, list(text))[:2] == ((content or ""), calls)


@pytest.mark.parametrize("parallel", [None, False])
def test_parallel_tool_calls_false_returns_the_first_call_whole_and_streamed(
        parallel: bool | None) -> None:
    req = schema.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": USER, "tools": TOOLS, "parallel_tool_calls": parallel})
    pieces = [HERMES[i:i + 7] for i in range(0, len(HERMES), 7)]
    msgs = [generate_pb2.GenerateResponse(request_id="r", text=t) for t in pieces]
    msgs[-1].finish_reason = generate_pb2.FINISH_REASON_STOP
    meta = convert.ResponseMeta.new("chatcmpl", "r", "m")
    wanted = KNOWN[0][3][:1 if parallel is False else None]
    whole = convert.chat_completion(msgs, meta, False, "hermes", convert.max_tool_calls(req))
    message = whole.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == wanted
    assert (message.content, whole.choices[0].finish_reason) == ("Let me look.", "tool_calls")

    async def stream() -> list[schema.ChatCompletionChunk]:
        async def responses() -> AsyncIterator[generate_pb2.GenerateResponse]:
            for m in msgs:
                yield m
        return [c async for c in convert.chat_chunks(
            responses(), meta, False, False, "hermes", convert.max_tool_calls(req))]

    calls: dict[int, list[str]] = {}
    for chunk in asyncio.run(stream()):
        for d in chunk.choices[0].delta.tool_calls or ():
            calls.setdefault(d["index"], ["", ""])
            calls[d["index"]][0] += d["function"].get("name", "")
            calls[d["index"]][1] += d["function"]["arguments"]
    assert [tuple(c) for c in calls.values()] == wanted


@pytest.mark.parametrize("kind", PARSERS)
@pytest.mark.parametrize("several", [True, False])
def test_a_forced_call_in_either_format_parses_and_fits_its_schema(kind: str,
                                                                   several: bool) -> None:
    """Random walks through the grammar (the built-in byte vocabulary) to its end (the
    grammar complete, or end-of-sequence where it may end): whatever is sampled, the output
    is calls the same format's parser reads, with arguments valid under their function's
    schema."""
    grammar = GuidanceBackend(load_tokenizer("tiny")).compile(
        Constraint("grammar", call_grammar(kind, TOOLS, several)))  # type: ignore[arg-type]
    tokenizer = load_tokenizer("tiny")
    rng = random.Random(7)
    for _ in range(4):
        matcher, out = grammar.matcher(), []
        while not matcher.is_stopped():
            words = np.frombuffer(matcher.allowed_mask(), dtype="<u4")
            token = int(rng.choice(np.flatnonzero(np.unpackbits(words.view(np.uint8),
                                                                bitorder="little"))))
            if token in tokenizer.special.eos_ids:
                break
            assert matcher.consume(token)
            out.append(token)
        content, calls = parse_whole(kind, tokenizer.decode(out))  # type: ignore[arg-type]
        assert content is None and calls and (several or len(calls) == 1)
        for call in calls:
            _check_call(call.name, call.arguments)


def test_the_parser_is_told_from_the_template() -> None:
    assert detect_parser((qwen2_5_dir() / "tokenizer_config.json").read_text()) == "hermes"
    assert detect_parser("{{ '<|python_tag|>' }}{% if tools %}...{% endif %}") == "llama3_json"
    assert detect_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None


def test_tools_and_tool_turns_render_as_transformers_renders_them() -> None:
    directory = qwen2_5_dir()
    ours = load_tokenizer(directory)
    args = {"city": "Paris", "unit": "c"}
    conversation = [
        ChatMessage("user", (TextPart("Weather in Paris?"),)),
        ChatMessage("assistant", (), (ToolCall("call_1", "get_weather", args),)),
        ChatMessage("tool", (TextPart('{"temp": 21}'),), tool_call_id="call_1"),
    ]
    hf = [{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": args}}]},
          {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}]
    expected = reference_tokenizer(directory).apply_chat_template(
        hf, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    rendered = ours.render_chat(conversation, tools=TOOLS)
    assert rendered == expected
    assert '"name": "get_time"' in rendered and "<tool_response>" in rendered


# --- end to end ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cell, str]]:
    """``tandem serve`` over a tiny random Qwen2 with Qwen2.5's template and tool tokens."""
    tokenizer = qwen2_5_dir()
    end, im_end = (load_tokenizer(tokenizer).encode(t, add_special_tokens=False)[0]
                   for t in ("<|endoftext|>", "<|im_end|>"))
    model_dir = save(reference("qwen2", vocab_size=load_tokenizer(tokenizer).vocab_size,
                               bos_token_id=end, eos_token_id=im_end),
                     tmp_path_factory.mktemp("qwen2.5-tools") / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, model_dir / name)
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": end, "eos_token_id": [im_end, end]}))
    port = free_port()
    with running_cell(tmp_path_factory.mktemp("cell"), "--model", str(model_dir),
                      "--http-listen", f"127.0.0.1:{port}") as cell:
        yield cell, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def url(served: tuple[Cell, str]) -> str:
    return served[1]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _model(url: str) -> str:
    return _client(url).models.list().data[0].id


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_yields_valid_calls(url: str) -> None:
    client = _client(url)
    answer = client.chat.completions.create(
        model=_model(url), messages=USER, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, seed=1)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    _check_call(call.function.name, call.function.arguments)


def test_a_named_function_streams_as_openai_streams_calls(url: str) -> None:
    stream = _client(url).chat.completions.create(
        model=_model(url), messages=USER, tools=TOOLS, stream=True, max_tokens=120, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    deltas, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            reasons.append(choice.finish_reason)
            assert not choice.delta.content
    assert reasons[-1] == "tool_calls"
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_time")
    assert first.id.startswith("call_")
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None
                        for d in rest), "later deltas carry argument fragments only"
    _check_call("get_time", "".join(d.function.arguments or "" for d in deltas))


def test_auto_and_none(url: str) -> None:
    client = _client(url)
    auto = client.chat.completions.create(model=_model(url), messages=USER, tools=TOOLS,
                                          max_tokens=8, seed=1)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(model=_model(url), messages=USER, tools=TOOLS,
                                          tool_choice="none", max_tokens=8, seed=1)
    assert none.choices[0].message.tool_calls is None
    plain = client.chat.completions.create(model=_model(url), messages=USER, max_tokens=8,
                                           seed=1)
    # none leaves the tools out of the prompt: the same prompt as without tools
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens


def test_a_conversation_with_calls_and_results(url: str) -> None:
    messages: list[dict[str, Any]] = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    answer = _client(url).chat.completions.create(model=_model(url), messages=messages,
                                                  tools=TOOLS, max_tokens=4, seed=1)
    assert answer.usage.prompt_tokens > 0


@pytest.mark.parametrize(("change", "param", "words"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not in tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools.0.function.name", "Field required"),
    ({"tools": {"type": "function"}}, "tools", "valid list"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "contradict"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "minProperties": "two"}}}]},
     "tools", "grammar"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time",
                                                     "arguments": "{not json"}}]}]},
     None, "arguments are not valid JSON"),
])
def test_bad_tool_requests_are_400(url: str, change: dict[str, Any], param: str | None,
                                   words: str) -> None:
    body = {"model": _model(url), "messages": USER, "tools": TOOLS, **change}
    answer = httpx.post(f"{url}/v1/chat/completions",
                        json={k: v for k, v in body.items() if v is not None}, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
