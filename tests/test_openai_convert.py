"""The OpenAI <-> Tandem conversion, the HTTP error table and the remote-image guard,
without a server (the HTTP tests in test_openai_http.py run them against real cells)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator

import httpx
import pydantic
import pytest

from tandem.errors import (
    HTTP_STATUS,
    InvalidInput,
    NotFound,
    Unavailable,
    http_error,
)
from tandem.openai_api import convert, schema
from tandem.openai_api.remote_images import (
    REFUSED,
    RemoteImageFetcher,
    is_public,
    resolve_public,
)
from tandem.v1 import generate_pb2
from tandem_testing.cells import png

IMAGE = png(1)
DATA_URI = "data:image/png;base64," + base64.b64encode(IMAGE).decode()


def chat(**fields: object) -> schema.ChatCompletionRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    return schema.ChatCompletionRequest.model_validate(body)


def test_chat_request_maps_messages_images_and_sampling() -> None:
    req = chat(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "look: "},
                                     {"type": "image_url", "image_url": {"url": DATA_URI}}]},
        {"role": "assistant", "content": None}],
        max_completion_tokens=7, temperature=0, seed=3, stop="END", top_k=5, min_p=0.1,
        repetition_penalty=1.2, presence_penalty=0.5, min_tokens=2, logprobs=True,
        top_logprobs=3, cache_salt="tenant", stop_token_ids=[9], ignore_eos=True)
    msg = convert.chat_request(req, "rid-1")
    assert msg.request_id == "rid-1" and msg.cache_salt == "tenant" and not msg.prompt
    assert [m.role for m in msg.messages] == ["system", "user", "assistant"]
    user = msg.messages[1].content
    assert user[0].text == "look: "
    assert user[1].image.encoded == IMAGE and user[1].image.mime_type == "image/png"
    assert len(msg.messages[2].content) == 0
    s = msg.sampling
    assert (s.max_tokens, s.temperature, s.seed, list(s.stop), s.top_k) == (7, 0, 3, ["END"], 5)
    assert s.min_p == pytest.approx(0.1) and s.repetition_penalty == pytest.approx(1.2)
    assert (s.presence_penalty, s.min_tokens, s.logprobs, s.top_logprobs) == (0.5, 2, True, 3)
    assert list(s.stop_token_ids) == [9] and s.ignore_eos
    assert not s.HasField("top_p")  # unset stays the server's default


def test_unset_fields_keep_the_servers_defaults_and_openais_temperature() -> None:
    s = convert.chat_request(chat()).sampling
    assert s.temperature == convert.DEFAULT_TEMPERATURE == 1.0
    assert not s.HasField("max_tokens") and not s.HasField("seed")
    assert not s.HasField("repetition_penalty") and not s.logprobs


@pytest.mark.parametrize(("fields", "param", "reason"), [
    ({"n": 2}, "n", "UNSUPPORTED"),
    ({"top_logprobs": 2}, "top_logprobs", "BAD_SAMPLING"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", "BAD_SAMPLING"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]},
     "messages[0].content[0].image_url.url", "REMOTE_IMAGE_DISABLED"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}]}]},
     "messages[0].content[0].image_url.url", "BAD_IMAGE"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}]},
     "messages[0].content[0].image_url.url", "BAD_IMAGE"),
])
def test_chat_requests_the_proto_cannot_express_are_refused_by_field(
        fields: dict[str, object], param: str, reason: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        convert.chat_request(chat(**fields))
    assert (caught.value.param, caught.value.reason) == (param, reason)
    assert http_error(caught.value)[0] == 400


def test_fetched_remote_images_are_used_as_given() -> None:
    url = "https://example.com/cat.png"
    req = chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_url", "image_url": {"url": DATA_URI}}]}])
    assert convert.remote_image_urls(req) == [url]
    msg = convert.chat_request(req, fetched={url: (b"jpeg bytes", "image/jpeg")})
    assert msg.messages[0].content[0].image.encoded == b"jpeg bytes"
    assert msg.messages[0].content[0].image.mime_type == "image/jpeg"


def test_completion_request() -> None:
    body = {"model": "tiny", "prompt": ["a <image>"], "max_tokens": 4, "logprobs": 2}
    msg = convert.completion_request(schema.CompletionRequest.model_validate(body), "r")
    assert (msg.prompt, msg.sampling.max_tokens, msg.sampling.logprobs,
            msg.sampling.top_logprobs) == ("a <image>", 4, True, 2)
    for bad, param in [({"prompt": ["a", "b"]}, "prompt"), ({"echo": True}, "echo"),
                       ({"suffix": "x"}, "suffix"), ({"n": 3}, "n")]:
        req = schema.CompletionRequest.model_validate({**body, **bad})
        with pytest.raises(InvalidInput) as caught:
            convert.completion_request(req)
        assert caught.value.param == param


@pytest.mark.parametrize("body", [
    {"model": "tiny", "messages": []},
    {"model": "tiny", "messages": [{"role": "function", "content": "x"}]},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "functions": []},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
     "tools": [{"type": "function", "function": {"name": "has space"}}]},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
     "tools": [{"type": "retrieval"}]},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": "any"},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "seed": 2**64},
    {"messages": [{"role": "user", "content": "x"}]},
])
def test_the_schema_refuses_what_tandem_does_not_serve(body: dict[str, object]) -> None:
    with pytest.raises(pydantic.ValidationError):
        schema.ChatCompletionRequest.model_validate(body)


def response(text: str, ids: list[int], finish: int = 0, **usage: int,
             ) -> generate_pb2.GenerateResponse:
    msg = generate_pb2.GenerateResponse(request_id="r1", text=text, token_ids=ids,
                                        finish_reason=finish)
    for token_id in ids:
        text = f"<{token_id}>"
        msg.logprobs.add(token=generate_pb2.TokenLogprob(token_id=token_id, text=text,
                                                         token_bytes=text.encode(),
                                                         logprob=-0.5),
                         top_logprobs=[generate_pb2.TokenLogprob(token_id=1, text="a",
                                                                 token_bytes=b"a",
                                                                 logprob=-0.1)])
    if usage:
        msg.usage.CopyFrom(generate_pb2.Usage(**usage))
    return msg


STREAM = [response("Hel", [5, 6]), response("", [7]),
          response("lo", [8], generate_pb2.FINISH_REASON_LENGTH, prompt_tokens=10,
                   completion_tokens=4, cached_prompt_tokens=8, mm_items=2, mm_cache_hits=1,
                   encoder_runs=1)]
META = convert.ResponseMeta("chatcmpl-r1", 1700000000, "tiny")


async def _iterate(items: list[generate_pb2.GenerateResponse],
                   ) -> AsyncIterator[generate_pb2.GenerateResponse]:
    for item in items:
        yield item


async def _all(it: AsyncIterator[object]) -> list[object]:
    return [x async for x in it]


def test_chat_chunks_and_usage() -> None:
    chunks = asyncio.run(_all(convert.chat_chunks(_iterate(STREAM), META, True, True)))
    assert chunks[0].choices[0].delta.role == "assistant"
    # one chunk per message: "" carries a token (and its logprob), so it is not dropped
    assert [c.choices[0].delta.content for c in chunks[1:4]] == ["Hel", "", "lo"]
    assert [c.choices[0].finish_reason for c in chunks[1:4]] == [None, None, "length"]
    assert [p.token for c in chunks[1:4] for p in c.choices[0].logprobs.content] == [
        "<5>", "<6>", "<7>", "<8>"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.total_tokens == 14
    assert last.usage.prompt_tokens_details.cached_tokens == 8
    assert last.usage.tandem.model_dump() == {"mm_items": 2, "mm_cache_hits": 1,
                                              "encoder_runs": 1, "images": [],
                                              "constraint": None}
    without = asyncio.run(_all(convert.chat_chunks(_iterate(STREAM), META, False, False)))
    assert all(c.usage is None and c.choices[0].logprobs is None for c in without)


def test_whole_answers() -> None:
    whole = convert.chat_completion(STREAM, META, True)
    assert whole.choices[0].message.content == "Hello"
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 4
    assert whole.choices[0].logprobs.content[0].bytes == list(b"<5>")
    assert whole.choices[0].logprobs.content[0].top_logprobs[0].token == "a"
    legacy = convert.completion(STREAM, META, True)
    assert legacy.choices[0].text == "Hello"
    assert legacy.choices[0].logprobs.text_offset == [0, 3, 6, 9]
    assert legacy.choices[0].logprobs.top_logprobs[0] == {"a": pytest.approx(-0.1)}
    streamed = asyncio.run(_all(convert.completion_chunks(_iterate(STREAM), META, True, True)))
    assert [o for c in streamed[:-1] for o in c.choices[0].logprobs.text_offset] == [0, 3, 6, 9]


def test_one_table_gives_grpc_and_http_their_status() -> None:
    assert http_error(InvalidInput("bad", "BAD_IMAGE", "messages"))[1] == {"error": {
        "message": "bad", "type": "invalid_request_error", "param": "messages",
        "code": "bad_image"}}
    status, body = http_error(NotFound("no such model", "MODEL_NOT_FOUND", "model"))
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert http_error(Unavailable("down"))[0] == 503
    status, body = http_error(RuntimeError("secret internals /etc/passwd"))
    assert status == 500 and "secret" not in body["error"]["message"]
    assert all(400 <= status < 600 for status, _ in HTTP_STATUS.values())


@pytest.mark.parametrize(("address", "public"), [
    ("8.8.8.8", True), ("2001:4860:4860::8888", True), ("127.0.0.1", False),
    ("10.1.2.3", False), ("192.168.0.1", False), ("172.16.0.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("::1", False), ("fe80::1", False),
    ("fd00::1", False), ("::ffff:127.0.0.1", False), ("224.0.0.1", False), ("0.0.0.0", False),
])
def test_only_public_addresses_are_fetched(address: str, public: bool) -> None:
    assert is_public(address) is public


def test_a_host_that_resolves_to_loopback_is_refused() -> None:
    with pytest.raises(InvalidInput) as caught:
        asyncio.run(resolve_public("localhost", 80, "messages"))
    assert caught.value.reason == REFUSED


def test_the_fetchers_body_limit() -> None:
    async def read(body: bytes, limit: int) -> bytes:
        return await RemoteImageFetcher._body(httpx.Response(200, content=body), "messages",
                                              limit)

    assert asyncio.run(read(b"x" * 100, 100)) == b"x" * 100
    with pytest.raises(InvalidInput, match="larger than 99 bytes"):
        asyncio.run(read(b"x" * 100, 99))


def test_usage_attributes_each_image() -> None:
    u = generate_pb2.Usage(mm_items=2, images=[
        generate_pb2.ImageUsage(key="abc", processor_cache=generate_pb2.PROCESSOR_CACHE_RESULT_HIT,
                                transport=generate_pb2.IMAGE_TRANSPORT_SHM,
                                encoder=generate_pb2.ENCODER_RESULT_SKIPPED, cached_tokens=12,
                                tokens=12),
        generate_pb2.ImageUsage(key="def",
                                processor_cache=generate_pb2.PROCESSOR_CACHE_RESULT_REFUSED,
                                refused_reason="oversize",
                                transport=generate_pb2.IMAGE_TRANSPORT_INLINE, tokens=64)])
    assert [i.model_dump() for i in convert.usage(u).tandem.images] == [
        {"key": "abc", "processor_cache": "hit", "refused_reason": "", "transport": "shm",
         "encoder": "skipped", "cached_tokens": 12, "tokens": 12},
        {"key": "def", "processor_cache": "refused", "refused_reason": "oversize",
         "transport": "inline", "encoder": "", "cached_tokens": 0, "tokens": 64}]
