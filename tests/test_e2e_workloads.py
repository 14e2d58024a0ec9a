"""Local cells under real workloads: prefix caching on vs off, cache pressure, concurrency,
and every class of bad input with its status code."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from tandem.feature_codec import tensor_to_proto
from tandem.v1 import generate_pb2
from tandem_testing.cells import png, request, running_cell

WORKLOAD = [
    ("Tell me about <image> and stop.", [1]),
    ("Tell me about <image> and stop.", [1]),
    ("Compare <image> with <image> now.", [2, 1]),
    ("No image here, just text that is long enough to fill a couple of blocks.", []),
    ("No image here, just text that is long enough to fill a couple of blocks!", []),
    ("Compare <image> with <image> now.", [2, 1]),
]


def _run_workload(cell) -> list[list[int]]:
    return [cell.generate(p, [png(s) for s in seeds], max_tokens=10)[0] for p, seeds in WORKLOAD]


def test_prefix_caching_on_and_off_give_identical_greedy_outputs(tmp_path: Path) -> None:
    with running_cell(tmp_path / "on") as cell:
        on = _run_workload(cell)
        assert cell.stats().prefix_cache_hit_tokens_total > 0
    with running_cell(tmp_path / "off", "--no-enable-prefix-caching") as cell:
        off = _run_workload(cell)
        assert cell.stats().prefix_cache_hit_tokens_total == 0
    assert on == off


def test_more_distinct_images_than_the_segment_holds(tmp_path: Path) -> None:
    # One 112x84 image is ~28 KB of pixel_values: a 200 KiB segment holds about 6.
    with running_cell(tmp_path, "--mm-cache-size", "200Ki") as cell:
        for i in range(24):
            _, _, last = cell.generate("What is <image>?", [png(100 + i)], max_tokens=2)
            assert last.usage.mm_items == 1
            stats = cell.stats()
            assert stats.shm_unacked_refs == 0
            assert stats.shm_used_bytes <= stats.shm_capacity_bytes
        assert stats.mm_cache_misses_total == 24 and 1 <= stats.shm_objects <= 8
        # An early image was evicted: asking for it again misses and still works.
        _, _, last = cell.generate("What is <image>?", [png(100)], max_tokens=2)
        assert last.usage.mm_cache_hits == 0
        assert cell.stats().shm_unacked_refs == 0


def test_concurrent_streams_with_cancellations(tmp_path: Path) -> None:
    images = [png(s) for s in range(4)]
    with running_cell(tmp_path, "--workers", "2") as cell:
        expected = {}
        for i in range(4):  # references, one at a time
            expected[i] = cell.generate(f"Stream {i}: <image> tell", [images[i]],
                                        max_tokens=16)[0]
        results: dict[int, object] = {}

        def client(n: int) -> None:
            i = n % 4
            msg = request(f"Stream {i}: <image> tell", [images[i]], max_tokens=16)
            try:
                stream = cell.stub.Generate(msg, timeout=120)
                ids: list[int] = []
                for k, out in enumerate(stream):
                    ids.extend(out.token_ids)
                    if n % 5 == 4 and k == 2:
                        stream.cancel()
                        results[n] = "cancelled"
                        return
                results[n] = ids
            except grpc.RpcError as exc:
                results[n] = "cancelled" if exc.code() == grpc.StatusCode.CANCELLED else exc

        threads = [threading.Thread(target=client, args=(n,)) for n in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert len(results) == 16
        for n, got in results.items():
            if n % 5 == 4:
                assert got == "cancelled"
            else:
                assert got == expected[n % 4], f"stream {n} differs"
        stats = cell.stats()
        assert stats.shm_unacked_refs == 0
        assert stats.kv_blocks_free == stats.kv_blocks_total


def _jpeg_truncated() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()[:100]


def _bomb() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, format="PNG")  # small file, 400 Mpx decoded
    return buf.getvalue()


def _tensor_image(t: torch.Tensor) -> generate_pb2.GenerateRequest:
    msg = request("Look: <image>")
    msg.images.add().tensor.CopyFrom(tensor_to_proto(t))
    return msg


def _no_data_image() -> generate_pb2.GenerateRequest:
    msg = request("Look: <image>")
    msg.images.add()
    return msg


def _stop_token(token: int) -> generate_pb2.GenerateRequest:
    msg = request("hi")
    msg.sampling.stop_token_ids.append(token)
    return msg


BAD = {
    "corrupt-png": (request("<image>", [b"\x89PNG\r\n\x1a\nnot really"]), "INVALID_ARGUMENT"),
    "truncated-jpeg": (request("<image>", [_jpeg_truncated()]), "INVALID_ARGUMENT"),
    # The first image is stored (a reference issued) before the second fails to decode.
    "good-then-truncated": (request("<image><image>", [png(7), png(8)[:600]]),
                            "INVALID_ARGUMENT"),
    "zero-size": (request("<image>", [b""]), "INVALID_ARGUMENT"),
    "one-pixel": (request("<image>", [png(1, 1, 1)]), "OK"),
    "bomb": (request("<image>", [_bomb()]), "INVALID_ARGUMENT"),
    "too-many-images": (request("<image>" * 9, [png(1)] * 9), "INVALID_ARGUMENT"),
    "marker-mismatch": (request("<image> <image>", [png(1)]), "INVALID_ARGUMENT"),
    "empty-prompt": (request("", []), "INVALID_ARGUMENT"),
    "prompt-too-long": (request("x" * 5000), "INVALID_ARGUMENT"),
    "max-tokens-0": (request("hi", max_tokens=0), "INVALID_ARGUMENT"),
    "max-tokens-huge": (request("hi", max_tokens=100000), "INVALID_ARGUMENT"),
    "temperature-negative": (request("hi", temperature=-1.0), "INVALID_ARGUMENT"),
    "top-p-zero": (request("hi", top_p=0.0), "INVALID_ARGUMENT"),
    "top-p-over-one": (request("hi", top_p=1.5), "INVALID_ARGUMENT"),
    "top-k-below": (request("hi", top_k=-2), "INVALID_ARGUMENT"),
    "tensor-bad-dtype": (_tensor_image(torch.zeros(28, 28, 3, dtype=torch.int64)),
                         "INVALID_ARGUMENT"),
    "tensor-bad-shape": (_tensor_image(torch.zeros(28, 28)), "INVALID_ARGUMENT"),
    "tensor-out-of-range": (_tensor_image(torch.full((28, 28, 3), 2.0)), "INVALID_ARGUMENT"),
    "message-too-large": (request("<image>", [b"\x89PNG" + bytes(170 * 2**20)]),
                          "RESOURCE_EXHAUSTED"),
    # A readable header but a cut body: refused after the image before it was cached.
    "truncated-png-after-a-good-one": (request("<image> <image>", [png(3), png(4)[:400]]),
                                       "INVALID_ARGUMENT"),
    "image-without-data": (_no_data_image(), "INVALID_ARGUMENT"),
    "temperature-nan": (request("hi", temperature=float("nan")), "INVALID_ARGUMENT"),
    "stop-token-outside-vocabulary": (_stop_token(10**6), "INVALID_ARGUMENT"),
}


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory):
    with running_cell(tmp_path_factory.mktemp("bad")) as c:
        yield c


def test_concurrent_first_requests_for_one_image_process_it_once(cell) -> None:
    image = png(4242, 200, 120)
    before = cell.stats()
    results: list[object] = []

    def client() -> None:
        try:
            results.append(cell.generate("Same picture <image> at once", [image], 4)[2].usage)
        except grpc.RpcError as exc:
            results.append(exc)

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 4 and all(not isinstance(r, Exception) for r in results), results
    assert sum(u.mm_cache_hits for u in results) == 3
    after = cell.stats()
    assert after.mm_cache_misses_total - before.mm_cache_misses_total == 1
    assert after.shm_unacked_refs == 0


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_gets_a_clear_status(cell, case: str) -> None:
    msg, code = BAD[case]
    if code == "OK":
        assert list(cell.stub.Generate(msg, timeout=60))[-1].finish_reason != 0
    else:
        with pytest.raises(grpc.RpcError) as err:
            list(cell.stub.Generate(msg, timeout=60))
        assert err.value.code().name == code, err.value.details()
        assert err.value.details() and "Traceback" not in err.value.details()
    # The server keeps serving and leaks nothing.
    _, _, last = cell.generate("still fine?", max_tokens=2)
    assert last.usage.completion_tokens >= 1
    stats = cell.stats()
    assert stats.shm_unacked_refs == 0 and stats.kv_blocks_free == stats.kv_blocks_total
