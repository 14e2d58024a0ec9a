"""What happens to a request before it is queued: its images are hashed off the event loop,
and the admission bound (``--max-waiting-requests``, ``--max-waiting-image-bytes``) refuses
what would wait beyond it, over gRPC (RESOURCE_EXHAUSTED with RetryInfo) and HTTP (429
with ``Retry-After`` and an OpenAI error object), leaving nothing held.

The hashing check runs an in-process engine over a real worker process; the bound is
tested black-box on a real ``tandem serve`` cell: first step by step (a long request holds
the only running slot, so what waits stays put), then with a flood of concurrent requests
over both ports.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from engines import generate, running_engine
from google.rpc import error_details_pb2, status_pb2
from workers import running_worker

from scheduler_svc import image_processor
from tandem.errors import error_info
from tandem.v1 import generate_pb2
from tandem_testing.cells import Cell, free_port, png, request, running_cell
from tandem_testing.metrics import scrape
from worker_svc.config import WorkerConfig

PROMPT = "Look at <image> and say"
IMAGE = png(5, 448, 448)  # about 600 KB of noise: two of them exceed the byte bound
MAX_WAITING = 4
MAX_WAITING_BYTES = len(IMAGE) + len(IMAGE) // 2


def test_images_are_hashed_off_the_event_loop(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Hashing reads every byte of an image (a 20 MiB one takes tens of milliseconds):
    on the event loop it would stop every stream of the cell meanwhile."""
    hashed_in: list[threading.Thread] = []
    digest = image_processor._digest

    def recording(*parts: bytes | memoryview) -> str:
        hashed_in.append(threading.current_thread())
        return digest(*parts)

    monkeypatch.setattr(image_processor, "_digest", recording)

    async def main() -> None:
        async with running_engine(tmp_path) as engine:
            tokens = await generate(engine, request(PROMPT + " <image>", [png(1), png(2)],
                                                    max_tokens=2))
            assert len(tokens) == 2

    with running_worker(WorkerConfig(shm_dir=str(tmp_path), kv_cache_bytes=4 << 20)):
        asyncio.run(main())
    assert len(hashed_in) == 2, "each image is hashed once"
    assert threading.main_thread() not in hashed_in, "hashed on the event loop's thread"


@dataclass
class BoundedCell:
    cell: Cell
    url: str  # the OpenAI-compatible HTTP base
    metrics: int

    def waiting(self) -> tuple[float, float]:
        m = scrape(self.metrics)
        return m["tandem_waiting_requests"], m["tandem_waiting_image_bytes"]

    def rejected(self) -> dict[str, float]:
        m = scrape(self.metrics)
        return {limit: m[f"tandem_rejected_requests_total{{limit={limit}}}"]
                for limit in ("requests", "image_bytes")}

    def model_server_metrics(self) -> tuple[float, float, float]:
        """The inference extension's gauges (vLLM names): running, waiting, KV use; checked
        against CacheStats, with the cache config an endpoint picker reads, and the same on
        the HTTP port's /metrics (where a picker scrapes a pool's target port)."""
        stats, m = self.cell.stats(), scrape(self.metrics)
        on_http = scrape(int(self.url.rsplit(":", 1)[1]))
        assert {k: v for k, v in on_http.items() if k.startswith("vllm:")} == {
            k: v for k, v in m.items() if k.startswith("vllm:")}
        total, free = stats.kv_blocks_total, stats.kv_blocks_free
        assert m["vllm:kv_cache_usage_perc"] == pytest.approx((total - free) / total)
        assert m[f"vllm:cache_config_info{{block_size=16,num_gpu_blocks={total}}}"] == 1
        return (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"],
                m["vllm:kv_cache_usage_perc"])

    def released(self) -> bool:
        """Nothing held: no request, SHM reference or KV block, nothing waiting."""
        stats, m = self.cell.stats(), scrape(self.metrics)
        return (stats.requests_in_flight == 0 and stats.shm_unacked_refs == 0
                and stats.kv_blocks_free == stats.kv_blocks_total
                and m["tandem_shm_ledger_refs"] == 0 and m["tandem_waiting_requests"] == 0
                and m["tandem_waiting_image_bytes"] == 0)


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BoundedCell]:
    """One running request at a time, at most MAX_WAITING waiting."""
    tmp = tmp_path_factory.mktemp("bounded")
    http, metrics = free_port(), free_port()
    with running_cell(tmp, "--max-num-seqs", "1", "--max-waiting-requests", str(MAX_WAITING),
                      "--max-waiting-image-bytes", str(MAX_WAITING_BYTES),
                      "--http-listen", f"127.0.0.1:{http}", "--http-metrics",
                      "--metrics-port", str(metrics)) as cell:
        yield BoundedCell(cell, f"http://127.0.0.1:{http}", metrics)


def _until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@contextlib.contextmanager
def _resumed_after(pid: int) -> Iterator[None]:
    """SIGCONT ``pid`` on the way out, whatever happened (a stopped worker would hang the
    module's other tests)."""
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _retry_info(exc: grpc.RpcError) -> error_details_pb2.RetryInfo | None:
    for key, value in exc.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == "grpc-status-details-bin":
            for detail in status_pb2.Status.FromString(value).details:
                retry = error_details_pb2.RetryInfo()
                if detail.Unpack(retry):
                    return retry
    return None


def _assert_overloaded_grpc(exc: grpc.RpcError, mentions: str) -> None:
    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert mentions in exc.details()  # type: ignore[attr-defined]
    info, retry = error_info(exc), _retry_info(exc)
    assert info is not None and info.reason == "OVERLOADED"
    assert retry is not None and retry.retry_delay.seconds >= 1


def _assert_overloaded_http(reply: httpx.Response, mentions: str) -> None:
    assert reply.status_code == 429, reply.text
    assert int(reply.headers["retry-after"]) >= 1
    error = reply.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
    assert mentions in error["message"]


def _chat(url: str, text: str, image: bytes | None = None, max_tokens: int = 4,
          ) -> httpx.Response:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image is not None:
        uri = "data:image/png;base64," + base64.b64encode(image).decode()
        content.append({"type": "image_url", "image_url": {"url": uri}})
    return httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "ignore_eos": True})


def _run(cell: Cell, msg: generate_pb2.GenerateRequest) -> generate_pb2.GenerateResponse:
    *_, last = cell.stub.Generate(msg, timeout=120)
    return last


def test_what_waits_is_bounded_by_count_and_image_bytes(bounded: BoundedCell) -> None:
    """A long request holds the only running slot and the worker is paused (SIGSTOP), so
    whatever is admitted waits, however fast the machine: one image request fits the byte
    bound, a second does not; text requests fill the count. The model-server gauges an
    endpoint picker scrapes show the one running, the ones waiting and the KV blocks held."""
    cell = bounded.cell
    hog = cell.stub.Generate(request("hold the slot", max_tokens=1000, ignore_eos=True),
                             timeout=120)
    next(hog)  # running: what comes next waits
    worker, = cell.worker_pids()
    os.kill(worker, signal.SIGSTOP)  # resumed well within the step timeout
    with ThreadPoolExecutor(8) as pool, _resumed_after(worker):
        waiting = [pool.submit(_run, cell, request(PROMPT, [IMAGE], max_tokens=2))]
        _until(lambda: bounded.waiting() == (1, len(IMAGE)))
        # a second image over HTTP would hold more image bytes than the bound
        _assert_overloaded_http(_chat(bounded.url, "and this", png(6, 448, 448)),
                                "bytes of images")
        with pytest.raises(grpc.RpcError) as refused:
            _run(cell, request(PROMPT, [png(7, 448, 448)], max_tokens=2))
        _assert_overloaded_grpc(refused.value, "bytes of images")
        for i in range(MAX_WAITING - 1):
            waiting.append(pool.submit(_run, cell, request(f"text {i}", max_tokens=2)))
        _until(lambda: bounded.waiting()[0] == MAX_WAITING)
        running, queued, kv_use = bounded.model_server_metrics()
        assert (running, queued) == (1, MAX_WAITING) and 0 < kv_use < 1
        with pytest.raises(grpc.RpcError) as refused:
            _run(cell, request("one too many", max_tokens=2))
        _assert_overloaded_grpc(refused.value, f"{MAX_WAITING} requests are waiting")
        _assert_overloaded_http(_chat(bounded.url, "one too many"), "requests are waiting")
        assert bounded.rejected() == {"requests": 2, "image_bytes": 2}
        os.kill(worker, signal.SIGCONT)
        hog.cancel()
        assert all(f.result().finish_reason == generate_pb2.FINISH_REASON_LENGTH
                   for f in waiting)
    _until(bounded.released)
    assert bounded.model_server_metrics() == (0, 0, 0)


def test_a_flood_is_refused_in_part_and_ends_with_nothing_held(bounded: BoundedCell) -> None:
    """Many clients at once over both ports, some with images: each request completes or
    is refused as overloaded, never anything else; then nothing is held."""
    before = sum(bounded.rejected().values())

    def grpc_client(i: int) -> str:
        images = [png(100 + i, 448, 448)] if i % 3 == 0 else []
        try:
            last = _run(bounded.cell, request(PROMPT if images else f"flood {i}", images,
                                              max_tokens=8, ignore_eos=True))
        except grpc.RpcError as exc:
            _assert_overloaded_grpc(exc, "the server is overloaded")
            return "refused"
        assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert len(last.usage.images) == len(images)
        return "done"

    def http_client(i: int) -> str:
        reply = _chat(bounded.url, f"flood {i}", png(200 + i, 448, 448) if i % 3 == 0 else None,
                      max_tokens=8)
        if reply.status_code == 429:
            _assert_overloaded_http(reply, "the server is overloaded")
            return "refused"
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        return "done"

    with ThreadPoolExecutor(32) as pool:
        outcomes = list(pool.map(lambda i: (grpc_client if i % 2 else http_client)(i // 2),
                                 range(48)))
    assert "refused" in outcomes and "done" in outcomes, outcomes
    assert sum(bounded.rejected().values()) - before == outcomes.count("refused")
    _until(bounded.released)
