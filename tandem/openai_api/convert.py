"""OpenAI <-> Tandem: pydantic request -> ``GenerateRequest``, response stream -> OpenAI bodies.

Pure functions (the streams only iterate what they are given), tested without a server.
Every OpenAI field maps onto a ``GenerateRequest`` field; the scheduler then validates
the values exactly as it does for gRPC, so both APIs accept and refuse the same requests.
What the proto cannot express is refused here, with the field named: ``n`` other than 1,
several prompts in one request, images given as remote URLs that were not fetched,
``echo`` and ``suffix``. ``response_format`` and vLLM's ``structured_outputs`` become the
proto's constraint. Tools go to the chat template (``tools_json``); a forced call
(``tool_choice`` ``required`` or a named function) is a grammar constraint, and the output's
calls are read by the cell's tool-call parser (:mod:`tandem.openai_api.tool_calls`).
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass

from tandem.errors import BadConstraint, InvalidInput, NotFound, RequestTooLarge
from tandem.openai_api import schema
from tandem.openai_api.tool_calls import (
    PARSERS,
    CallDelta,
    ParserKind,
    ToolCallParser,
    call_grammar,
    parse_whole,
)
from tandem.request_limits import base64_length
from tandem.v1 import generate_pb2

# OpenAI's temperature default (the proto's 0 would mean greedy decoding).
DEFAULT_TEMPERATURE = 1.0
DATA_URI_PREFIX = "data:"
FINISH_REASONS = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
    generate_pb2.FINISH_REASON_CONSTRAINT: "error",
}


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """What every body of one response repeats: its id, creation time and model name."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, request_id: str, model: str) -> ResponseMeta:
        return cls(f"{prefix}-{request_id}", int(time.time()), model)


# --- requests ----------------------------------------------------------------------------

def check_model(model: str, info: generate_pb2.GetModelInfoResponse) -> None:
    """A request's ``model`` must be one of the served names (404 ``model_not_found``
    otherwise, as OpenAI answers)."""
    names = list(info.served_model_names) or [info.model_id]  # a cell from before the names
    if model not in names:
        served = ", ".join(f"`{n}`" for n in names)
        raise NotFound(f"The model `{model}` does not exist (this server serves {served}; "
                       "see GET /v1/models)", "MODEL_NOT_FOUND", "model")


def chat_request(req: schema.ChatCompletionRequest, request_id: str = "",
                 fetched: Mapping[str, tuple[bytes, str]] | None = None,
                 max_image_bytes: int | None = None,
                 tool_call_parser: str = "") -> generate_pb2.GenerateRequest:
    """A chat completion request as a GenerateRequest in chat form.

    ``fetched``: remote image URL -> (bytes, MIME type) for the URLs the server fetched
    (only when remote images are enabled); any other non-``data:`` URL is refused.
    ``max_image_bytes``: the cell's image limit; a ``data:`` URI too long to fit it is
    refused before it is decoded (None: no check here, the cell's alone).
    ``tool_call_parser``: the cell's (``GetModelInfoResponse.tool_call_parser``).
    """
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidInput("top_logprobs needs logprobs: true", "BAD_SAMPLING", "top_logprobs")
    if (req.max_tokens is not None and req.max_completion_tokens is not None
            and req.max_tokens != req.max_completion_tokens):
        raise InvalidInput("max_tokens and max_completion_tokens differ: set one",
                           "BAD_SAMPLING", "max_completion_tokens")
    msg = generate_pb2.GenerateRequest(request_id=request_id, cache_salt=req.cache_salt or "")
    for i, message in enumerate(req.messages):
        out = msg.messages.add(role="system" if message.role == "developer" else message.role,
                               tool_call_id=message.tool_call_id or "")
        for call in message.tool_calls or ():
            out.tool_calls.add(id=call.id, name=call.function.name,
                               arguments=call.function.arguments)
        content = message.content
        if isinstance(content, str):
            out.content.add(text=content)
            continue
        for j, part in enumerate(content or ()):
            if isinstance(part, schema.TextContent):
                out.content.add(text=part.text)
            else:
                param = f"messages[{i}].content[{j}].image_url.url"
                out.content.add(image=media_item(part.image_url.url, param, fetched or {},
                                                 max_image_bytes))
    max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                  else req.max_tokens)
    msg.sampling.CopyFrom(sampling(req, max_tokens, req.logprobs, req.top_logprobs or 0))
    _tools(req, msg, tool_call_parser)
    return msg


def tool_parser(req: schema.ChatCompletionRequest, cell_parser: str) -> ParserKind | None:
    """The parser that reads this request's output: the cell's, when the request offers
    tools and allows calling them (``tool_choice`` other than ``none``)."""
    if not req.tools or req.tool_choice == "none" or cell_parser not in PARSERS:
        return None
    return cell_parser  # type: ignore[return-value]  # one of PARSERS


def _tools(req: schema.ChatCompletionRequest, msg: generate_pb2.GenerateRequest,
           cell_parser: str) -> None:
    """``tools`` into the template's input and a forced ``tool_choice`` into a grammar.

    ``tool_choice: none`` leaves the tools out of the prompt as well (vLLM renders them
    unless told otherwise): a model shown tools tends to call them, and its calls would
    then be returned as text."""
    choice, tools = req.tool_choice, req.tools or []
    forced = forces_call(req)
    if forced and not tools:
        raise InvalidInput(f"tool_choice {_choice_name(choice)} needs tools",
                           "BAD_TOOLS", "tool_choice")
    names = [t.function.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise InvalidInput(f"tools define the function {duplicate!r} more than once",
                           "BAD_TOOLS", "tools")
    if isinstance(choice, schema.NamedToolChoice) and choice.function.name not in names:
        raise InvalidInput(f"tool_choice names the function {choice.function.name!r}, which "
                           f"is not in tools ({', '.join(names)})", "BAD_TOOLS", "tool_choice")
    parser = tool_parser(req, cell_parser)
    if not tools or choice == "none":
        return
    if parser is None:
        raise InvalidInput("this model has no tool-call format the server can read (its chat "
                           "template shows none); the server's --tool-call-parser can name "
                           "one", "TOOLS_UNSUPPORTED", "tools")
    msg.tools_json = json.dumps([t.model_dump(exclude_none=True) for t in tools])
    if not forced:
        return
    if msg.sampling.WhichOneof("constraint") is not None:
        raise InvalidInput(f"tool_choice {_choice_name(choice)} forces a tool call, which "
                           "response_format or structured_outputs would contradict; set one",
                           "BAD_TOOLS", "tool_choice")
    chosen = [t for t in tools if not isinstance(choice, schema.NamedToolChoice)
              or t.function.name == choice.function.name]
    msg.sampling.grammar = call_grammar(
        parser, [t.model_dump(exclude_none=True) for t in chosen],
        several=choice == "required" and req.parallel_tool_calls is not False)


def max_tool_calls(req: schema.ChatCompletionRequest) -> int | None:
    """``parallel_tool_calls: false`` returns one call (a forced one is also generated
    alone: :func:`call_grammar`'s ``several``); with ``auto``, calls the model writes past
    the first are dropped, as vLLM drops them."""
    return 1 if req.parallel_tool_calls is False else None


def forces_call(req: schema.ChatCompletionRequest | schema.CompletionRequest) -> bool:
    """Whether ``tool_choice`` forces a call (``required`` or a named function): then the
    request's constraint is the grammar of the calls, and a schema it refuses is in
    ``tools``."""
    return isinstance(req, schema.ChatCompletionRequest) and (
        req.tool_choice == "required" or isinstance(req.tool_choice, schema.NamedToolChoice))


def _choice_name(choice: object) -> str:
    if isinstance(choice, schema.NamedToolChoice):
        return f"{{'function': {{'name': {choice.function.name!r}}}}}"
    return repr(choice)


def completion_request(req: schema.CompletionRequest,
                       request_id: str = "") -> generate_pb2.GenerateRequest:
    """A (legacy) completion request: one prompt, a string tokenized as is or token ids
    used as they are."""
    prompt = _one_prompt(req.prompt)
    if req.echo:
        raise InvalidInput("echo is not supported", "UNSUPPORTED", "echo")
    if req.suffix:
        raise InvalidInput("suffix is not supported", "UNSUPPORTED", "suffix")
    msg = generate_pb2.GenerateRequest(request_id=request_id, cache_salt=req.cache_salt or "")
    if isinstance(prompt, str):
        msg.prompt = prompt
    else:
        msg.prompt_token_ids.extend(prompt)
    msg.sampling.CopyFrom(sampling(req, req.max_tokens, req.logprobs is not None,
                                   req.logprobs or 0))
    return msg


def _one_prompt(prompt: str | list[str] | list[int] | list[list[int]]) -> str | list[int]:
    """The prompt as a string or token ids: ``"text"``, ``["text"]``, ``[1, 2]`` or
    ``[[1, 2]]``; a list of several prompts is refused (one request, one choice)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return prompt  # type: ignore[return-value]
    if len(prompt) != 1:
        raise InvalidInput(f"prompt must be one prompt (a list of {len(prompt)} was given; "
                           "send one request per prompt)", "INVALID_INPUT", "prompt")
    return prompt[0]  # type: ignore[return-value]


def sampling(req: schema.SamplingFields, max_tokens: int | None, logprobs: bool,
             top_logprobs: int) -> generate_pb2.SamplingParams:
    """The shared sampling fields; unset optional ones stay unset (the server's default)."""
    if req.n != 1:
        raise InvalidInput(f"n must be 1 (got {req.n}): send one request per choice",
                           "UNSUPPORTED", "n")
    if req.stream_options is not None and not req.stream:
        # OpenAI's own refusal, word for word.
        raise InvalidInput("The 'stream_options' parameter is only allowed when 'stream' is "
                           "enabled.", "INVALID_REQUEST", "stream_options")
    s = generate_pb2.SamplingParams(
        temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        top_k=req.top_k or 0, min_p=req.min_p or 0.0,
        stop=[req.stop] if isinstance(req.stop, str) else req.stop or [],
        stop_token_ids=req.stop_token_ids or [],
        include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens or 0, presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0, logprobs=logprobs,
        top_logprobs=top_logprobs)
    if max_tokens is not None:
        s.max_tokens = max_tokens
    if req.top_p is not None:
        s.top_p = req.top_p
    if req.seed is not None:
        s.seed = req.seed
    if req.repetition_penalty is not None:
        s.repetition_penalty = req.repetition_penalty
    _constraint(req, s)
    return s


def _constraint(req: schema.SamplingFields, s: generate_pb2.SamplingParams) -> None:
    """``response_format`` (OpenAI) or ``structured_outputs`` (vLLM) as the proto's
    constraint; the scheduler compiles it (a bad one: 400 with ``param: response_format``)."""
    fmt, extra = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and extra is not None:
        raise BadConstraint("set response_format or structured_outputs, not both")
    if fmt is not None and fmt.type == "json_object":
        s.json_object = True
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise BadConstraint("response_format of type json_schema needs its json_schema "
                                "({\"name\": ..., \"schema\": {...}})")
        schema_ = fmt.json_schema.schema_
        s.json_schema = json.dumps({} if schema_ is None else schema_)
    elif extra is not None:
        _structured_outputs(extra, s)


def _structured_outputs(extra: schema.StructuredOutputs, s: generate_pb2.SamplingParams,
                        ) -> None:
    kinds = [k for k, v in (("json", extra.json_), ("regex", extra.regex),
                            ("choice", extra.choice), ("grammar", extra.grammar),
                            ("json_object", extra.json_object)) if v is not None]
    if len(kinds) != 1:
        raise InvalidInput(f"structured_outputs must set exactly one of json, regex, choice, "
                           f"grammar and json_object (got {kinds or 'none'})",
                           "BAD_CONSTRAINT", "structured_outputs")
    if extra.json_ is not None:
        s.json_schema = (extra.json_ if isinstance(extra.json_, str)
                         else json.dumps(extra.json_))
    elif extra.regex is not None:
        s.regex = extra.regex
    elif extra.choice is not None:
        s.choice.choices.extend(extra.choice)
    elif extra.grammar is not None:
        s.grammar = extra.grammar
    else:
        s.json_object = bool(extra.json_object)


def media_item(url: str, param: str, fetched: Mapping[str, tuple[bytes, str]],
               max_image_bytes: int | None = None) -> generate_pb2.MediaItem:
    """One ``image_url``: a base64 ``data:`` URI, or a remote URL the server fetched."""
    if url in fetched:
        data, mime = fetched[url]
        return generate_pb2.MediaItem(encoded=data, mime_type=mime)
    if not url.startswith(DATA_URI_PREFIX):
        raise InvalidInput(
            "remote image URLs are not enabled on this server; send the image inline as a "
            "data: URI (data:image/png;base64,...)", "REMOTE_IMAGE_DISABLED", param)
    header, comma, payload = url[len(DATA_URI_PREFIX):].partition(",")
    mime, *params = header.split(";")
    if not comma or "base64" not in params:
        raise InvalidInput("an image data: URI must be base64 (data:image/png;base64,...)",
                           "BAD_IMAGE", param)
    if max_image_bytes is not None and len(payload) > base64_length(max_image_bytes):
        raise RequestTooLarge(f"the image is larger than {max_image_bytes} bytes (its "
                              f"base64 is {len(payload)} characters)", param=param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput("the image data: URI is not valid base64", "BAD_IMAGE",
                           param) from None
    return generate_pb2.MediaItem(encoded=data, mime_type=mime)


def image_urls(req: schema.ChatCompletionRequest) -> list[str]:
    """The request's image URLs (``data:`` URIs and remote ones), in order."""
    return [part.image_url.url for m in req.messages if isinstance(m.content, list)
            for part in m.content if isinstance(part, schema.ImageContent)]


def remote_image_urls(req: schema.ChatCompletionRequest) -> list[str]:
    """The request's image URLs that are not ``data:`` URIs, in order."""
    return [url for url in image_urls(req) if not url.startswith(DATA_URI_PREFIX)]


# --- responses ---------------------------------------------------------------------------

def usage(u: generate_pb2.Usage) -> schema.Usage:
    return schema.Usage(
        prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
        prompt_tokens_details=schema.PromptTokensDetails(cached_tokens=u.cached_prompt_tokens),
        tandem=schema.TandemUsage(mm_items=u.mm_items, mm_cache_hits=u.mm_cache_hits,
                                  encoder_runs=u.encoder_runs,
                                  images=[image_usage(i) for i in u.images],
                                  constraint=(schema.TandemConstraintUsage(
                                      kind=u.constraint.kind,
                                      compile_ms=u.constraint.compile_ms,
                                      cache_hit=u.constraint.cache_hit)
                                      if u.HasField("constraint") else None)))


def image_usage(i: generate_pb2.ImageUsage) -> schema.TandemImageUsage:
    """The gRPC ``ImageUsage`` with its enums as lowercase words ("" = unspecified)."""
    return schema.TandemImageUsage(
        key=i.key, refused_reason=i.refused_reason, cached_tokens=i.cached_tokens,
        tokens=i.tokens,
        processor_cache=_word(generate_pb2.ProcessorCacheResult.Name(i.processor_cache)),
        transport=_word(generate_pb2.ImageTransport.Name(i.transport)),
        encoder=_word(generate_pb2.EncoderResult.Name(i.encoder)))


def _word(enum_name: str) -> str:
    """``PROCESSOR_CACHE_RESULT_HIT`` -> ``hit``: the value after the enum's own prefix."""
    for prefix in ("PROCESSOR_CACHE_RESULT_", "IMAGE_TRANSPORT_", "ENCODER_RESULT_"):
        if enum_name.startswith(prefix):
            word = enum_name.removeprefix(prefix).lower()
            return "" if word == "unspecified" else word
    raise ValueError(f"not an attribution enum value: {enum_name}")


def finish_reason(msg: generate_pb2.GenerateResponse) -> str | None:
    return FINISH_REASONS.get(msg.finish_reason)


def chat_logprobs(positions: Iterable[generate_pb2.PositionLogprobs],
                  ) -> schema.ChoiceLogprobs:
    def top(t: generate_pb2.TokenLogprob) -> schema.TopLogprob:
        return schema.TopLogprob(token=t.text, logprob=t.logprob, bytes=list(t.token_bytes))

    return schema.ChoiceLogprobs(content=[
        schema.TokenLogprob(**top(p.token).model_dump(), top_logprobs=[
            top(t) for t in p.top_logprobs]) for p in positions])


class TextOffsets:
    """Where each token of one output starts in its text (the legacy ``text_offset``),
    counted on the tokens' bytes as the text was decoded from them: a token holding part
    of a character starts where that character does, bytes that make no character count
    as the U+FFFD the text shows for them, and a special token, which the text skips,
    adds nothing. (Counting each token's own decoded text instead would count a
    U+FFFD for every piece of a split character.)"""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0  # characters decoded so far

    def next(self, token: generate_pb2.TokenLogprob) -> int:
        """The offset of ``token``, the output's next token."""
        if token.special:
            return self._chars
        pending, _ = self._utf8.getstate()  # bytes of a character not finished yet
        offset = self._chars
        if pending and not _continues(pending, token.token_bytes):
            offset += len(pending.decode("utf-8", "replace"))  # they were not one: U+FFFD
        self._chars += len(self._utf8.decode(token.token_bytes))
        return offset


def _continues(pending: bytes, data: bytes) -> bool:
    """Whether ``data``'s first byte carries on the unfinished character ``pending``."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(pending + data[:1])
    except UnicodeDecodeError:
        return False
    return True


def completion_logprobs(positions: Sequence[generate_pb2.PositionLogprobs],
                        offsets: TextOffsets) -> schema.CompletionLogprobs:
    """The legacy form; ``offsets`` has seen the output's earlier tokens."""
    return schema.CompletionLogprobs(
        tokens=[p.token.text for p in positions],
        token_logprobs=[p.token.logprob for p in positions],
        top_logprobs=[{t.text: t.logprob for t in p.top_logprobs} for p in positions],
        text_offset=[offsets.next(p.token) for p in positions])


def chat_completion(msgs: Sequence[generate_pb2.GenerateResponse], meta: ResponseMeta,
                    with_logprobs: bool, parser: ParserKind | None = None,
                    max_calls: int | None = None) -> schema.ChatCompletion:
    """A whole (non-streamed) chat completion from the request's response messages;
    ``parser`` reads tool calls out of the text (None: the text is the content), of which
    the first ``max_calls`` are returned (:func:`max_tool_calls`)."""
    last = msgs[-1]
    content: str | None = "".join(m.text for m in msgs)
    calls = []
    if parser is not None:
        content, calls = parse_whole(parser, content)
        calls = calls[:max_calls]
    return schema.ChatCompletion(
        id=meta.id, created=meta.created, model=meta.model,
        choices=[schema.ChatChoice(
            message=schema.ChatMessageOut(content=content, tool_calls=[
                schema.ToolCallOut(id=c.id, function=schema.FunctionCallOut(
                    name=c.name, arguments=c.arguments)) for c in calls] or None),
            logprobs=(chat_logprobs(p for m in msgs for p in m.logprobs)
                      if with_logprobs else None),
            finish_reason=_chat_finish(last, bool(calls)))],
        usage=usage(last.usage))


def _chat_finish(last: generate_pb2.GenerateResponse, called: bool) -> str:
    """OpenAI's ``tool_calls`` for a message that ends in calls (not one cut short)."""
    reason = finish_reason(last) or "abort"
    return "tool_calls" if called and reason == "stop" else reason


def _call_delta(d: CallDelta) -> dict[str, object]:
    if d.id is None:
        return {"index": d.index, "function": {"arguments": d.arguments}}
    return {"index": d.index, "id": d.id, "type": "function",
            "function": {"name": d.name, "arguments": d.arguments}}


def completion(msgs: Sequence[generate_pb2.GenerateResponse], meta: ResponseMeta,
               with_logprobs: bool) -> schema.Completion:
    last = msgs[-1]
    return schema.Completion(
        id=meta.id, created=meta.created, model=meta.model,
        choices=[schema.CompletionChoice(
            text="".join(m.text for m in msgs),
            logprobs=(completion_logprobs([p for m in msgs for p in m.logprobs],
                                          TextOffsets())
                      if with_logprobs else None),
            finish_reason=finish_reason(last) or "abort")],
        usage=usage(last.usage))


async def chat_chunks(msgs: AsyncIterator[generate_pb2.GenerateResponse], meta: ResponseMeta,
                      with_logprobs: bool, include_usage: bool,
                      parser: ParserKind | None = None, max_calls: int | None = None,
                      ) -> AsyncIterator[schema.ChatCompletionChunk]:
    """The streamed form: a first chunk with the role, one per message that carries text
    or a finish reason, then (``include_usage``) one with no choices and the usage.
    With a tool-call ``parser``, a message's text becomes content and tool-call deltas
    (text that may still begin a call is held back until it is known), those of the first
    ``max_calls`` calls only."""
    calls = None if parser is None else ToolCallParser(parser)

    def chunk(delta: schema.Delta, msg: generate_pb2.GenerateResponse | None = None,
              ) -> schema.ChatCompletionChunk:
        choice = schema.ChatChunkChoice(delta=delta)
        if msg is not None:
            choice.finish_reason = (finish_reason(msg) if calls is None or not msg.finish_reason
                                    else _chat_finish(msg, bool(calls.calls)))
            if with_logprobs:
                choice.logprobs = chat_logprobs(msg.logprobs)
        return schema.ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model,
                                          choices=[choice])

    def delta(msg: generate_pb2.GenerateResponse) -> schema.Delta:
        if calls is None:
            return schema.Delta(content=msg.text)
        parsed = calls.feed(msg.text)
        if msg.finish_reason:
            parsed.content += calls.finish().content
        parsed.calls = [d for d in parsed.calls if max_calls is None or d.index < max_calls]
        if not parsed.calls:
            return schema.Delta(content=parsed.content)
        return schema.Delta(content=parsed.content or None,
                            tool_calls=[_call_delta(d) for d in parsed.calls])

    yield chunk(schema.Delta(role="assistant", content=""))
    last = None
    async for last in msgs:
        if not (last.text or last.logprobs or last.finish_reason):
            continue
        d = delta(last)
        if d.content or d.tool_calls or last.logprobs or last.finish_reason:
            yield chunk(d, last)
    if include_usage and last is not None:
        yield schema.ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model,
                                         choices=[], usage=usage(last.usage))


async def completion_chunks(msgs: AsyncIterator[generate_pb2.GenerateResponse],
                            meta: ResponseMeta, with_logprobs: bool, include_usage: bool,
                            ) -> AsyncIterator[schema.Completion]:
    offsets = TextOffsets()
    last = None
    async for last in msgs:
        if not (last.text or last.logprobs or last.finish_reason):
            continue
        choice = schema.CompletionChoice(text=last.text, finish_reason=finish_reason(last))
        if with_logprobs:
            choice.logprobs = completion_logprobs(last.logprobs, offsets)
        yield schema.Completion(id=meta.id, created=meta.created, model=meta.model,
                                choices=[choice])
    if include_usage and last is not None:
        yield schema.Completion(id=meta.id, created=meta.created, model=meta.model,
                                choices=[], usage=usage(last.usage))


def model_list(info: generate_pb2.GetModelInfoResponse, created: int) -> schema.ModelList:
    return schema.ModelList(data=[schema.ModelCard(
        id=info.model_id, created=created, max_model_len=info.max_context_length)])
