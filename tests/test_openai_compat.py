"""What an OpenAI SDK user meets (issue 22, items 12-15), black-box over HTTP with the real
``openai`` client (raw httpx for bodies the SDK would not send) against a ``tandem serve``
cell started with ``--served-model-name``:

* model names: the first served name is reported (``/v1/models``, gRPC GetModelInfo, every
  answer's ``model``), any of them is accepted, another gets 404 ``model_not_found``;
* request fields: ``null`` means the default, ``response_format`` ``text`` is served
  (the structured ones: tests/test_structured_output.py), ``stream_options`` needs
  ``stream``, a prompt may be token ids;
* logprobs: ``bytes`` are the token's own bytes, ``text_offset`` counts decoded characters
  (the tiny model's vocabulary is bytes, so every piece of a non-ASCII character is a
  token; a real Qwen vocabulary through the scheduler's own conversion below);
* the chat template is rendered once at start, not on every request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from engines import running_engine
from workers import running_worker

from scheduler_svc.http_backend import EngineBackend
from scheduler_svc.servicer import logprobs_to_proto
from tandem.openai_api import convert
from tandem.openai_api.http_server import HttpConfig, HttpServer
from tandem.request_limits import max_http_body_bytes
from tandem.text.byte_tokenizer import BOS_ID
from tandem.text.hf_tokenizer import HFTokenizer
from tandem.tls import TlsFiles
from tandem.v1 import generate_pb2, generate_pb2_grpc, worker_pb2
from tandem_cli.cli import build_parser
from tandem_testing.cells import Cell, free_port, running_cell
from tandem_testing.text_checkpoints import llama3_style_dir, qwen2_vl_dir
from worker_svc.config import WorkerConfig

NAMES = ("tiny-chat", "tiny-alias")
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cell, str]]:
    """A cell serving ``tiny`` under NAMES, and its HTTP base URL."""
    port = free_port()
    with running_cell(tmp_path_factory.mktemp("compat"), "--http-listen", f"127.0.0.1:{port}",
                      "--served-model-name", *NAMES) as running:
        yield running, f"http://127.0.0.1:{port}"


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json=body, timeout=60)


def _model_info(channel: grpc.Channel) -> generate_pb2.GetModelInfoResponse:
    return generate_pb2_grpc.GenerationStub(channel).GetModelInfo(
        generate_pb2.GetModelInfoRequest(), timeout=10)


# --- item 13: served model names ---------------------------------------------------------

def test_the_first_served_name_is_reported_and_every_name_is_accepted(cell) -> None:
    running, url = cell
    client = _client(url)
    assert [m.id for m in client.models.list().data] == [NAMES[0]]
    info = _model_info(running.channel)
    assert info.model_id == NAMES[0] and list(info.served_model_names) == list(NAMES)
    for name in NAMES:
        answer = client.completions.create(model=name, prompt="Hi", max_tokens=2)
        assert answer.model == NAMES[0]
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="tiny", max_tokens=2,  # the --model, not a name
                                       messages=[{"role": "user", "content": "Hi"}])
    error = refused.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "`tiny`" in error["message"] and "`tiny-chat`" in error["message"]


def test_served_model_names_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_SERVED_MODEL_NAME", "org/model, short  other")
    for command in ("serve", "scheduler"):
        args = build_parser().parse_args([command])
        assert args.served_model_name == ["org/model", "short", "other"], command
    monkeypatch.delenv("TANDEM_SERVED_MODEL_NAME")
    assert build_parser().parse_args(["serve", "--served-model-name", "a", "b"]
                                     ).served_model_name == ["a", "b"]


# --- item 14: the fields OpenAI accepts and refuses --------------------------------------

def test_null_fields_mean_their_default(cell) -> None:
    _, url = cell
    chat = {"model": NAMES[0], "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3, "temperature": 0, "n": None, "stream": None, "logprobs": None,
            "top_logprobs": None, "stop": None, "seed": None, "stream_options": None,
            "tools": None, "tool_choice": None, "logit_bias": None, "user": None,
            "response_format": {"type": "text"}}
    answer = _post(url, "chat/completions", chat)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["logprobs"] is None
    completion = {"model": NAMES[0], "prompt": "Hi", "max_tokens": 3, "n": None,
                  "stream": None, "logprobs": None, "echo": None, "suffix": None}
    assert _post(url, "completions", completion).status_code == 200
    # the SDK, with response_format text
    _client(url).chat.completions.create(model=NAMES[0], max_tokens=2,
                                         response_format={"type": "text"},
                                         messages=[{"role": "user", "content": "Hi"}])


def test_stream_options_without_stream_is_refused_in_openais_words(cell) -> None:
    _, url = cell
    for stream in ({}, {"stream": False}):
        answer = _post(url, "chat/completions", {
            "model": NAMES[0], "messages": [{"role": "user", "content": "Hi"}],
            "stream_options": {"include_usage": True}, **stream})
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["param"] == "stream_options"
        assert error["message"] == ("The 'stream_options' parameter is only allowed when "
                                    "'stream' is enabled.")


def test_a_prompt_may_be_token_ids(cell) -> None:
    _, url = cell
    client = _client(url)
    ids = [BOS_ID, *b"Hello"]  # what the tiny model's tokenizer makes of "Hello"
    by_text = client.completions.create(model=NAMES[0], prompt="Hello", max_tokens=6,
                                        temperature=0)
    for prompt in (ids, [ids]):
        by_ids = client.completions.create(model=NAMES[0], prompt=prompt, max_tokens=6,
                                           temperature=0)
        assert by_ids.choices[0].text == by_text.choices[0].text
        assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as several:
        client.completions.create(model=NAMES[0], prompt=[ids, ids], max_tokens=2)
    assert several.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as outside:
        client.completions.create(model=NAMES[0], prompt=[1, 10**6], max_tokens=2)
    assert "outside the vocabulary" in outside.value.body["message"]


# --- item 12: logprob bytes and text offsets ---------------------------------------------

def test_logprob_bytes_are_the_tokens_own(cell) -> None:
    """Each token of the tiny model is one byte (or a special token): a piece of a
    character must report that byte, not U+FFFD's three, and the chosen tokens' bytes
    must make up the answer's text."""
    _, url = cell
    answer = _client(url).chat.completions.create(
        model=NAMES[0], max_tokens=24, temperature=0, logprobs=True, top_logprobs=5,
        messages=[{"role": "user", "content": "Describe a parrot 🦜 in French: très"}])
    content = answer.choices[0].logprobs.content
    tokens = [*content, *(t for c in content for t in c.top_logprobs)]
    pieces = [t for t in tokens if t.token == REPLACEMENT]
    assert pieces, "no token held part of a character: pick another prompt"
    assert all(len(t.bytes) == 1 and t.bytes[0] >= 0x80 for t in pieces)
    chosen = b"".join(bytes(c.bytes) for c in content if not _special(c.token))
    assert chosen.decode("utf-8", "replace") == answer.choices[0].message.content


def test_text_offsets_count_decoded_characters(cell) -> None:
    _, url = cell
    answer = _client(url).completions.create(
        model=NAMES[0], prompt="Un perroquet très coloré 🦜 dit", max_tokens=24,
        temperature=0, logprobs=0)
    text, lp = answer.choices[0].text, answer.choices[0].logprobs
    ascii_tokens = 0
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        if token != REPLACEMENT and not _special(token):  # an ASCII byte: where it says
            assert text[offset] == token, (offset, token, text)
            ascii_tokens += 1
    assert ascii_tokens and len(lp.tokens) > ascii_tokens, "no mix of ASCII and other tokens"
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)


def _special(token: str) -> bool:
    return token in ("<pad>", "<bos>", "<eos>", "<image>")


@pytest.mark.parametrize("directory", [qwen2_vl_dir, llama3_style_dir])
def test_a_real_vocabulary_reports_an_emojis_bytes(directory) -> None:
    """The Qwen vocabulary (byte-level BPE) splits 🫠 over three tokens; through the
    scheduler's logprobs conversion and the HTTP conversion, their bytes concatenate to
    its UTF-8 and each token's offset is where its text starts."""
    tokenizer = HFTokenizer.from_dir(directory())
    text = "a 🫠 b"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= 4, ids  # the emoji is split: the case at issue
    ids.append(tokenizer.special.eos_ids[0])
    sampled = [worker_pb2.SampledLogprobs(logprob=-1.0, top_token_ids=[t],
                                          top_logprobs=[-1.0]) for t in ids]
    msg = generate_pb2.GenerateResponse(
        request_id="r", token_ids=ids, text=text, finish_reason=generate_pb2.FINISH_REASON_STOP,
        logprobs=logprobs_to_proto(ids, sampled, tokenizer))
    meta = convert.ResponseMeta("x", 0, "m")
    chat = convert.chat_completion([msg], meta, True).choices[0].logprobs.content
    assert b"".join(bytes(c.bytes) for c in chat[:-1]) == text.encode()
    assert [bytes(c.bytes) for c in chat] == [bytes(c.top_logprobs[0].bytes) for c in chat]
    assert REPLACEMENT in "".join(c.token for c in chat)  # the pieces' own texts
    eos = tokenizer.decode([ids[-1]], skip_special_tokens=False)
    assert bytes(chat[-1].bytes) == eos.encode()
    legacy = convert.completion([msg], meta, True).choices[0].logprobs
    # "a" at 0, " \xf0\x9f" at 1 (its space), the emoji's other pieces where it starts (2),
    # " b" at 3, and the end-of-sequence token (not in the text) at the end
    assert legacy.text_offset == [0, 1, *[2] * (len(ids) - 4), 3, 5]


# --- item 15: the chat template is rendered once ----------------------------------------

def test_the_chat_template_is_not_rendered_per_request(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    with running_worker(WorkerConfig(shm_dir=str(shm), kv_cache_bytes=4 << 20)):
        asyncio.run(_count_renders(shm))


async def _count_renders(shm: Path) -> None:
    async with running_engine(shm) as engine:
        renders = 0
        render = engine.tokenizer.render_chat

        def counted(*args: Any, **kwargs: Any) -> str:
            nonlocal renders
            renders += 1
            return render(*args, **kwargs)

        engine.tokenizer.render_chat = counted  # type: ignore[method-assign]
        http = await HttpServer.start(EngineBackend(engine, None),
                                      HttpConfig(listen="127.0.0.1:0"), TlsFiles(),
                                      max_http_body_bytes(1 << 20))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http.port}/v1",
                                         timeout=60) as client:
                model = (await client.get("/models")).json()["data"][0]["id"]
                for _ in range(3):
                    answer = await client.post("/completions", json={
                        "model": model, "prompt": "Hi", "max_tokens": 2})
                    assert answer.status_code == 200, answer.text
                chat = await client.post("/chat/completions", json={
                    "model": model, "max_tokens": 2,
                    "messages": [{"role": "user", "content": "Hi"}]})
                assert chat.status_code == 200, chat.text
        finally:
            await http.stop(1.0)
        assert renders == 1, f"{renders} renders for one chat request"  # the chat's own
