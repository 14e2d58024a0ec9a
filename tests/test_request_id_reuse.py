"""A retry that reuses the id of a request the client just cancelled (what a proxy that keeps
``x-request-id`` does, or a gRPC client that keeps its ``request_id``) gets its own answer,
against a real ``tandem serve`` cell with asynchronous scheduling (two steps out).

The cancelled request is usually carried by both steps out when its cancel lands; the retry
is admitted in the next step. Before the fix, applying the older step credited the
cancelled request's token to the retry (its output drifted, or the engine's block
bookkeeping tripped and every request of the cell failed with INTERNAL); a retry that
raced the cancel was refused as a duplicate. Each retry's greedy output must equal a fresh
request's, over gRPC and over the HTTP port alike, and the cell must end with nothing held.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from tandem.v1 import generate_pb2
from tandem_testing.cells import Cell, free_port, request, running_cell

PROMPT = "Tell me a long story about the sea and its ships"
MAX_TOKENS = 12
ROUNDS = 20


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cell, str]]:
    """(cell, its HTTP base URL): async scheduling is on by default, checked below."""
    tmp = tmp_path_factory.mktemp("reuse")
    port = free_port()
    with running_cell(tmp, "--http-listen", f"127.0.0.1:{port}") as running:
        yield running, f"http://127.0.0.1:{port}"


def _msg(request_id: str) -> generate_pb2.GenerateRequest:
    msg = request(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    msg.request_id = request_id
    return msg


def _idle(cell: Cell, timeout: float = 20.0) -> generate_pb2.CacheStatsResponse:
    deadline = time.monotonic() + timeout
    while True:
        stats = cell.stats()
        if (stats.kv_blocks_free == stats.kv_blocks_total and stats.requests_in_flight == 0
                and stats.shm_unacked_refs == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_grpc_retry_after_cancel_with_the_same_id(cell: tuple[Cell, str]) -> None:
    c, _ = cell
    fresh, _, _ = c.stream(_msg("fresh-grpc"))
    assert len(fresh) == MAX_TOKENS
    for i in range(ROUNDS):
        stream = c.stub.Generate(_msg("reused-grpc"), timeout=60)
        with pytest.raises(grpc.RpcError) as cancelled:
            for k, _ in enumerate(stream):
                if k >= 1 + i % 4:  # leave mid-generation, after 2..5 messages
                    stream.cancel()
        assert cancelled.value.code() == grpc.StatusCode.CANCELLED
        retry, _, last = c.stream(_msg("reused-grpc"))  # at once, the same id
        assert last.request_id == "reused-grpc"
        assert retry == fresh, f"round {i}: the retry's tokens differ from a fresh request's"
    stats = _idle(c)
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.requests_in_flight == 0


def _http_tokens(http: httpx.Client, request_id: str, leave_after: int | None) -> str:
    """Stream a completion with ``x-request-id``; leave after ``leave_after`` events (the
    connection closes, as a client that gives up does), else the whole text."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text = ""
    with http.stream("POST", "/v1/completions", json=body,
                     headers={"x-request-id": request_id}) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["x-request-id"] == request_id
        events = 0
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            events += 1
            if leave_after is not None and events >= leave_after:
                break
    return text


def test_http_retry_after_disconnect_with_the_same_x_request_id(cell: tuple[Cell, str]) -> None:
    c, url = cell
    with httpx.Client(base_url=url, timeout=60) as http:
        fresh = _http_tokens(http, "fresh-http", None)
        for i in range(ROUNDS):
            # a connection of its own, closed on leaving: the cell sees the disconnect
            with httpx.Client(base_url=url, timeout=60) as leaving:
                _http_tokens(leaving, "reused-http", 1 + i % 4)
            assert _http_tokens(http, "reused-http", None) == fresh, f"round {i}"
    stats = _idle(c)
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.requests_in_flight == 0
