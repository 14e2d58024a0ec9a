"""The OpenAI-compatible HTTP API with the real ``openai`` client (and curl, and raw httpx
for what no SDK sends) against real ``tandem serve`` cells: answers equal gRPC's, streaming,
images, usage and cache figures, errors, client disconnects that release everything, traces
and metrics.

The two cells start once for the module (in parallel). The tiny built-in model's text is
noise, but deterministic.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from pki import make_pki

from tandem.v1 import generate_pb2
from tandem_testing.cells import (
    Cell,
    _wait_serving,
    free_port,
    png,
    running_cell,
    running_cells,
    stop_process,
)

MODEL = "tiny"
IMAGE = png(7)


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _client(url: str) -> openai.OpenAI:
    """The SDK against ``url`` (a cell's HTTP base)."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@dataclass
class HttpCell:
    cell: Cell
    url: str  # http://127.0.0.1:<port>
    trace_file: Path
    metrics_port: int

    def client(self) -> openai.OpenAI:
        return _client(self.url)


def _cell(tmp: Path) -> Any:
    port, metrics = free_port(), free_port()
    return port, metrics, running_cell(
        tmp, "--http-listen", f"127.0.0.1:{port}", "--trace-file", str(tmp / "trace.jsonl"),
        "--metrics-port", str(metrics))


@pytest.fixture(scope="module")
def cells(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[HttpCell]]:
    tmp = tmp_path_factory.mktemp("http-cells")
    started = [_cell(tmp / f"cell{i}") for i in range(2)]
    with running_cells([m for _, _, m in started]) as running:
        yield [HttpCell(cell, f"http://127.0.0.1:{port}", tmp / f"cell{i}" / "trace.jsonl",
                        metrics)
               for i, (cell, (port, metrics, _)) in enumerate(zip(running, started,
                                                                   strict=True))]


def _wait(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def _released(cell: Cell) -> bool:
    """Nothing held: no unacknowledged SHM reference, every KV block free."""
    stats = cell.stats()
    return stats.shm_unacked_refs == 0 and stats.kv_blocks_free == stats.kv_blocks_total


def _messages(text: str, image: bytes | None = None) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": data_uri(image)}})
    return [{"role": "system", "content": "You describe images."},
            {"role": "user", "content": content}]


def _grpc_chat(cell: Cell, text: str, image: bytes, max_tokens: int,
               ) -> tuple[str, list[float]]:
    """The same chat request over gRPC: its text and per-token logprobs."""
    msg = generate_pb2.GenerateRequest()
    msg.messages.add(role="system").content.add(text="You describe images.")
    user = msg.messages.add(role="user")
    user.content.add(text=text)
    user.content.add(image=generate_pb2.MediaItem(encoded=image))
    msg.sampling.max_tokens = max_tokens
    msg.sampling.logprobs = True
    out = list(cell.stub.Generate(msg, timeout=60))
    return "".join(m.text for m in out), [p.token.logprob for m in out for p in m.logprobs]


def test_chat_equals_grpc_streamed_or_not(cells: list[HttpCell]) -> None:
    client = cells[0].client()
    text, image = "What is in this picture?", png(11)
    whole = client.chat.completions.create(
        model=MODEL, messages=_messages(text, image), max_tokens=8, temperature=0,
        logprobs=True)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 8
    assert whole.id.startswith("chatcmpl-") and whole.model == MODEL
    grpc_text, grpc_logprobs = _grpc_chat(cells[0].cell, text, image, 8)
    assert choice.message.content == grpc_text
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(grpc_logprobs,
                                                                         abs=1e-5)
    # streamed: the same text; the usage chunk reports the caches the first call filled
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=_messages(text, image), max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == grpc_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 8
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0
    tandem = usage.model_extra["tandem"]
    [image] = tandem.pop("images")
    assert tandem == {"mm_items": 1, "mm_cache_hits": 1, "encoder_runs": 0, "constraint": None}
    assert (image["processor_cache"], image["transport"]) == ("hit", "shm")


def test_completions_and_models(cells: list[HttpCell]) -> None:
    client = cells[1].client()
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                      temperature=0, logprobs=2)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    assert len(whole.choices[0].logprobs.tokens) == 6
    assert all(len(top) <= 2 for top in whole.choices[0].logprobs.top_logprobs)
    streamed = list(client.completions.create(model=MODEL, prompt="Once upon a time",
                                              max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    [card] = client.models.list().data
    assert card.id == MODEL and card.model_extra["max_model_len"] > 0


def test_metrics_stay_off_the_http_port_by_default(cells: list[HttpCell]) -> None:
    """Only --http-metrics puts /metrics on the public port (docs/security.md)."""
    assert httpx.get(cells[0].url + "/metrics", timeout=10).status_code == 404


def test_request_id_header_and_curl(cells: list[HttpCell]) -> None:
    body = {"model": MODEL, "messages": _messages("hi"), "max_tokens": 3, "stream": True}
    out = subprocess.run(
        ["curl", "-sS", "-N", "-D", "-", f"{cells[0].url}/v1/chat/completions",
         "-H", "content-type: application/json", "-H", "x-request-id: curl-req-1",
         "-d", json.dumps(body)], capture_output=True, text=True, timeout=60, check=True).stdout
    head, _, events = out.partition("\n\n")  # text mode turned CRLF into LF
    assert head.startswith("HTTP/1.1 200") and "x-request-id: curl-req-1" in head.lower()
    assert "text/event-stream" in head
    datas = [line.removeprefix("data: ") for line in events.splitlines() if line]
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas[:-1]]
    assert {c["id"] for c in chunks} == {"chatcmpl-curl-req-1"}


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_errors_are_openai_error_objects(cells: list[HttpCell]) -> None:
    client = cells[0].client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=_messages("x"), n=2)
    assert _error(caught.value)["param"] == "n"
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=_messages("x"))
    assert _error(caught.value)["code"] == "model_not_found"
    remote = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/x.png"}}]}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=remote)
    assert _error(caught.value)["code"] == "remote_image_disabled"
    with pytest.raises(openai.BadRequestError) as caught:  # decoded and refused by the cell
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(b"not an image")}}]}])
    error = _error(caught.value)
    assert error["type"] == "invalid_request_error" and error["code"] == "image_corrupt"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert _error(caught.value)["code"] == "bad_sampling"


@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [', 400),
    ("POST", "/v1/chat/completions", b"[1, 2]", 400),
    ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", '
     b'"content": "x"}], "tools": []}', 400),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": 5}', 400),
    ("POST", "/v1/completions", b"model=tiny", 400),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "x", "seed": -1}', 400),
    ("POST", "/v1/models", b"", 405),
    ("GET", "/v1/engines", b"", 404),
])
def test_bad_input_for_every_endpoint(cells: list[HttpCell], method: str, path: str,
                                      body: bytes, status: int) -> None:
    reply = httpx.request(method, cells[0].url + path, content=body, timeout=30,
                          headers={"content-type": "application/json"})
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["message"] and "Traceback" not in reply.text and "pydantic" not in reply.text
    assert _released(cells[0].cell)


def test_a_disconnect_aborts_and_releases_everything(cells: list[HttpCell]) -> None:
    """Mid-stream and while a non-streamed answer is still being generated."""
    client = cells[0].client()
    long = {"model": MODEL, "messages": _messages("go on", png(31)),
            "max_tokens": 1000, "extra_body": {"ignore_eos": True}, "temperature": 0}
    with client.chat.completions.create(**long, stream=True) as stream:
        for i, _ in enumerate(stream):
            if i == 3:
                break
        assert not all(_released(c.cell) for c in cells)  # still generating
    _wait(lambda: all(_released(c.cell) for c in cells))
    impatient = openai.OpenAI(base_url=client.base_url, api_key="unused", max_retries=0,
                              timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(**long)
    _wait(lambda: all(_released(c.cell) for c in cells))


def test_http_requests_are_traced_and_measured_as_grpc_ones(cells: list[HttpCell]) -> None:
    cells[1].client().chat.completions.create(
        model=MODEL, messages=_messages("traced", IMAGE), max_tokens=2,
        extra_headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})

    def spans() -> list[dict[str, Any]]:
        if not cells[1].trace_file.exists():
            return []
        return [span for line in cells[1].trace_file.read_text().splitlines()
                for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"]
                for span in ss["spans"] if span["traceId"] == "0af7651916cd43dd8448eb211c80319c"]

    _wait(lambda: {"POST /v1/chat/completions", "generate_content tiny"}
          <= {s["name"] for s in spans()}, timeout=30)
    by_name = {s["name"]: s for s in spans()}
    server, generate = by_name["POST /v1/chat/completions"], by_name["generate_content tiny"]
    assert server["parentSpanId"] == "b7ad6b7169203331"
    assert generate["parentSpanId"] == server["spanId"]
    attributes = {a["key"]: a["value"] for a in generate["attributes"]}
    assert attributes["tandem.mm.items"] == {"intValue": "1"}
    metrics = httpx.get(f"http://127.0.0.1:{cells[1].metrics_port}/metrics", timeout=10).text
    count = next(line for line in metrics.splitlines()
                 if line.startswith("tandem_time_to_first_token_seconds_count"))
    assert float(count.split()[-1]) >= 1


def test_mutual_tls_and_the_remote_image_guard(tmp_path: Path) -> None:
    """The HTTP port takes the gRPC port's TLS files: with a client CA, only clients with a
    certificate it signed get an answer. With remote images enabled, a URL that resolves
    to this machine is refused before any connection is made."""
    pki = make_pki(tmp_path)
    port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "tandem_cli.cli", "serve", "--listen", f"127.0.0.1:{port}",
           "--http-listen", f"127.0.0.1:{http_port}", "--http-allow-remote-images",
           "--shm-dir", str(tmp_path / "shm"), "--kv-cache-size", "16Mi",
           "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
           "--tls-client-ca", str(pki.ca)]
    with open(tmp_path / "cell.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, TANDEM_DEBUG_INVARIANTS="1"))
    channel = grpc.secure_channel(f"127.0.0.1:{port}", pki.client(pki.client_cert,
                                                                     pki.client_key))
    try:
        _wait_serving(Cell(f"127.0.0.1:{port}", tmp_path / "shm", proc, channel), 90,
                      tmp_path / "cell.log")
        url = f"https://localhost:{http_port}"
        trusted = ssl.create_default_context(cafile=str(pki.ca))
        with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake fails
            httpx.get(f"{url}/v1/models", verify=trusted, timeout=10)
        trusted.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                               http_client=openai.DefaultHttpxClient(verify=trusted))
        assert client.models.list().data[0].id == MODEL
        local = [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": f"http://localhost:{http_port}/v1/models"}}]}]
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=local)
        assert _error(caught.value)["code"] == "remote_image_refused"
        # The client's pooled TLS connection is idle: the stop does not wait the grace (30
        # s) for its close_notify (it did, and this stop's SIGKILL orphaned the worker).
        stop_process(proc, 20)
        assert proc.returncode == 0, (tmp_path / "cell.log").read_text()[-3000:]
    finally:
        channel.close()
        stop_process(proc, 30)
