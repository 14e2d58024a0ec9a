"""The HTTP edge's bounds, black-box against a real ``tandem serve`` cell: request bodies
over the cap (declared or chunked) and oversize ``data:`` URIs get 413 before they are
held, a request with too many image URLs gets 400 before any fetch, a request's remote
images are fetched at once under one deadline and each within the cell's image limit,
malformed or disguised image URLs are the client's error (400), never a 500 with a
traceback, and the cell stays healthy with nothing held afterwards.

Remote images come from an HTTP server in this process on 127.0.0.1, which the cell may
reach through ``--http-remote-image-allow-networks 127.0.0.1/32``; the server counts what
it is asked for.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.request_limits import base64_length, max_http_body_bytes, max_message_bytes
from tandem_testing.cells import Cell, free_port, png, running_cell

MODEL = "tiny"
IMAGE = png(7)
MAX_IMAGES = 2
MAX_IMAGE_BYTES = 64 * 1024
BODY_CAP = max_http_body_bytes(max_message_bytes(MAX_IMAGES, MAX_IMAGE_BYTES))
FETCH_TIMEOUT_S = 2.0
STALL_S = 1.5  # how long a slow image takes: one fits the deadline, two in a row do not


@dataclass
class ImageServer:
    """Serves ``IMAGE`` at ``/img/*``; ``/pair/*`` answers only once two such requests are
    in flight together (else 500 after STALL_S); ``/slow/*`` takes STALL_S, one request at
    a time; ``/big/*`` is one byte over the cell's image limit."""

    port: int = 0
    paths: list[str] = field(default_factory=list)
    pair: threading.Barrier = field(default_factory=lambda: threading.Barrier(2))
    one_at_a_time: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def handle(self, path: str) -> tuple[int, bytes]:
        self.paths.append(path)
        if path.startswith("/pair/"):
            try:
                self.pair.wait(STALL_S)
            except threading.BrokenBarrierError:
                self.pair.reset()
                return 500, b""
        elif path.startswith("/slow/"):
            with self.one_at_a_time:
                time.sleep(STALL_S)
        elif path.startswith("/big/"):
            return 200, os.urandom(MAX_IMAGE_BYTES + 1)
        return 200, IMAGE


@pytest.fixture(scope="module")
def images() -> Iterator[ImageServer]:
    state = ImageServer()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = state.handle(self.path)
            try:
                self.send_response(status)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:  # the cell gave up on this fetch and closed the connection
                pass

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Edge:
    cell: Cell
    log: Path
    url: str  # http://127.0.0.1:<port>


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    tmp = tmp_path_factory.mktemp("http-limits")
    port = free_port()
    remote = ("--http-allow-remote-images", "--http-remote-image-allow-networks",
              "127.0.0.1/32", "--http-remote-image-timeout", str(FETCH_TIMEOUT_S))
    with running_cell(tmp, "--http-listen", f"127.0.0.1:{port}", *remote,
                      "--max-images", str(MAX_IMAGES),
                      "--max-image-bytes", str(MAX_IMAGE_BYTES)) as cell:
        yield Edge(cell, tmp / "cell.log", f"http://127.0.0.1:{port}")


def _chat(urls: list[str], max_tokens: int = 2) -> dict[str, Any]:
    content = [{"type": "text", "text": "describe"},
               *({"type": "image_url", "image_url": {"url": u}} for u in urls)]
    return {"model": MODEL, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}]}


def _post(base: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _raw(base: str, head: bytes, body: Iterable[bytes] = ()) -> tuple[int, bytes]:
    """Send ``head`` and then ``body``'s pieces on a socket, then read the answer the
    server gives while the body is still unfinished: (status, response body). A server
    that waits for the rest of the body times this out."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=15) as sock:
        sock.sendall(head)
        for piece in body:
            sock.sendall(piece)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head_out, _, payload = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head_out.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(payload) < length:
            payload += sock.recv(65536)
    return int(head_out.split()[1]), payload


def _released(cell: Cell) -> bool:
    stats = cell.stats()
    return stats.shm_unacked_refs == 0 and stats.kv_blocks_free == stats.kv_blocks_total


def _healthy(edge: Edge, base: str) -> None:
    """A normal request with an image still works, and the cell holds nothing after it."""
    response = _post(base, _chat(["data:image/png;base64," + base64.b64encode(IMAGE).decode()]))
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 20
    while not _released(edge.cell):
        assert time.monotonic() < deadline, "the cell still holds references or KV blocks"
        time.sleep(0.1)


REQUEST_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
                b"Content-Type: application/json\r\n")


def test_a_declared_oversize_body_is_refused_before_it_is_sent(edge: Edge) -> None:
    """Content-Length over the cap: 413 at once, without waiting for (or holding) a byte
    of the 10 GiB body; the connection is closed."""
    status, payload = _raw(edge.url, REQUEST_HEAD + b"Content-Length: %d\r\n\r\n"
                           % (10 * 2**30))
    assert status == 413
    error = json.loads(payload)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert "limit" in error["message"]
    _healthy(edge, edge.url)


def test_a_client_that_sends_its_oversize_body_whole_reads_the_413(edge: Edge) -> None:
    """httpx (and the SDKs on it) sends the whole body before reading: the answer waits
    for it, the body read and dropped, rather than a reset connection."""
    response = httpx.post(f"{edge.url}/v1/chat/completions",
                          content=b"x" * (BODY_CAP + 1),
                          headers={"content-type": "application/json"}, timeout=60)
    assert _error(response, 413)["code"] == "request_too_large"
    _healthy(edge, edge.url)


def test_a_chunked_body_is_refused_once_it_passes_the_cap(edge: Edge) -> None:
    """No Content-Length: the bytes are counted as they come, and the 413 comes as soon
    as they pass the cap, while the body is still unfinished (never its end)."""
    piece = b"x" * 65536
    pieces = BODY_CAP // len(piece) + 1
    chunks = (b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(pieces))
    status, payload = _raw(edge.url, REQUEST_HEAD + b"Transfer-Encoding: chunked\r\n\r\n",
                           chunks)
    assert status == 413 and b"request_too_large" in payload
    _healthy(edge, edge.url)


def test_a_body_within_the_cap_passes(edge: Edge) -> None:
    """The cap is the gRPC port's message cap in base64: two images at the limit fit."""
    at_limit = "data:image/png;base64," + base64.b64encode(bytes(MAX_IMAGE_BYTES)).decode()
    assert len(at_limit.partition(",")[2]) == base64_length(MAX_IMAGE_BYTES)
    body = _chat([at_limit, at_limit])
    # they are not PNGs: the cell (not the edge) refuses them, after decoding
    assert _error(_post(edge.url, body), 400)["code"] == "image_corrupt"


def test_an_oversize_data_uri_is_refused_before_it_is_decoded(edge: Edge) -> None:
    uri = "data:image/png;base64," + base64.b64encode(os.urandom(MAX_IMAGE_BYTES + 3)).decode()
    error = _error(_post(edge.url, _chat([uri])), 413)
    assert error["code"] == "request_too_large"
    assert error["param"] == "messages[0].content[1].image_url.url"
    assert f"larger than {MAX_IMAGE_BYTES} bytes" in error["message"]
    _healthy(edge, edge.url)


def test_too_many_image_urls_are_refused_before_any_fetch(edge: Edge,
                                                          images: ImageServer) -> None:
    before = len(images.paths)
    urls = [images.url(f"/img/{i}.png") for i in range(200)]
    error = _error(_post(edge.url, _chat(urls)), 400)
    assert error["code"] == "too_many_images"
    assert error["message"] == f"200 images; the limit is {MAX_IMAGES} per request"
    assert images.paths[before:] == []  # not one fetch


def test_a_requests_images_are_fetched_at_once(edge: Edge, images: ImageServer) -> None:
    """Each /pair/ image is served only while the other is being fetched too."""
    response = _post(edge.url, _chat([images.url("/pair/a.png"),
                                               images.url("/pair/b.png")]))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["tandem"]["mm_items"] == 2


def test_one_deadline_bounds_all_of_a_requests_fetches(edge: Edge, images: ImageServer) -> None:
    """Two slow images, served one after the other: each alone fits the deadline, both
    together do not, and the request fails at the deadline, not after both."""
    started = time.monotonic()
    response = _post(edge.url, _chat([images.url("/slow/a.png"),
                                               images.url("/slow/b.png")]))
    elapsed = time.monotonic() - started
    error = _error(response, 400)
    assert error["code"] == "remote_image_failed"
    assert f"longer than {FETCH_TIMEOUT_S} s" in error["message"]
    assert elapsed < 2 * STALL_S, f"answered after {elapsed:.1f} s"
    _healthy(edge, edge.url)


def test_a_remote_image_over_the_cells_image_limit_stops_its_fetch(edge: Edge,
                                                                    images: ImageServer) -> None:
    error = _error(_post(edge.url, _chat([images.url("/big/a.png")])), 400)
    assert error["code"] == "remote_image_failed"
    assert error["message"] == f"the image is larger than {MAX_IMAGE_BYTES} bytes"


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:99999/x.png", "http://[::1/x.png", "http://host:-1/x.png",
    "http://a..b/x.png",
])
def test_a_malformed_image_url_is_the_clients_error(edge: Edge, url: str) -> None:
    """400 naming the fault, and no traceback in the cell's log (nothing went wrong there)."""
    error = _error(_post(edge.url, _chat([url])), 400)
    assert error["param"] == "messages"
    assert error["code"] in ("remote_image_refused", "remote_image_failed")
    assert "Traceback" not in edge.log.read_text()


@pytest.mark.parametrize("address", [
    "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254, the cloud metadata address
    "::a9fe:a9fe",  # IPv4-compatible
    "::ffff:a9fe:a9fe",  # IPv4-mapped
    "::ffff:0:a9fe:a9fe",  # IPv4-translated
    "2002:a9fe:a9fe::1",  # 6to4
    "2001:0:808:808:0:0:f5fe:56fd",  # Teredo, client 10.1.169.2
])
def test_ipv6_forms_of_private_ipv4_are_refused(edge: Edge, address: str) -> None:
    """Refused before any connection is tried (remote_image_refused, not a failed fetch)."""
    error = _error(_post(edge.url, _chat([f"http://[{address}]/latest/meta-data"])),
                   400)
    assert error["code"] == "remote_image_refused"
