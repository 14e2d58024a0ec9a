"""Property-based fuzzing of GenerateRequest against a running cell (``tandem serve``).

Prompts with stray and missing ``<image>`` markers, images that are valid, truncated,
random bytes, raw tensors of any dtype and shape, or empty, client uuids, and sampling
values across and beyond their ranges (NaN and infinities included). Each request must end
with tokens or INVALID_ARGUMENT, within the deadline; the server keeps serving; afterwards
nothing is pinned or allocated, and a rejected request changed no prefix-cache counter.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.v1 import generate_pb2, tensor_pb2
from tandem_testing.cells import Cell, png, running_cell

GOOD = [png(1, 56, 56), png(2, 84, 56)]
ALLOWED = {"OK", "INVALID_ARGUMENT"}
U32 = st.integers(0, 2**32 - 1)


def _bytes_pool() -> list[bytes]:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(buf, format="JPEG")
    jpeg = buf.getvalue()
    return [*GOOD, jpeg, GOOD[0][: len(GOOD[0]) // 2], jpeg[:40], b"", b"\x89PNG\r\n\x1a\n"]


def media() -> st.SearchStrategy[generate_pb2.MediaItem]:
    tensor = st.builds(tensor_pb2.Tensor,
                       dtype=st.sampled_from(["float32", "float16", "int64", "uint8", "x"]),
                       shape=st.lists(st.integers(-1, 64), max_size=4),
                       data=st.binary(max_size=256))
    data = st.one_of(st.sampled_from(_bytes_pool()).map(lambda b: {"encoded": b}),
                     st.binary(max_size=64).map(lambda b: {"encoded": b}),
                     tensor.map(lambda t: {"tensor": t}), st.just({}))
    return st.builds(lambda d, uuid: generate_pb2.MediaItem(**d, **uuid), data,
                     st.one_of(st.just({}), st.sampled_from(["u1", "u2", ""]).map(
                         lambda u: {"uuid": u})))


def sampling() -> st.SearchStrategy[generate_pb2.SamplingParams]:
    floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
    optional = {
        "max_tokens": st.one_of(st.integers(0, 4), st.integers(1025, 2**32 - 1)),
        "top_p": st.one_of(floats, st.floats(0.25, 1.0, width=32)),
        "seed": st.integers(0, 2**64 - 1),
        "repetition_penalty": st.one_of(floats, st.floats(0.5, 2, width=32)),
        "presence_penalty": floats, "frequency_penalty": floats, "min_p": floats,
        "min_tokens": st.one_of(st.integers(0, 4), U32), "logprobs": st.booleans(),
        "top_logprobs": st.one_of(st.integers(0, 21), U32),
        "stop": st.lists(st.one_of(st.text(max_size=4), st.just("x" * 300)), max_size=18),
        "include_stop_str_in_output": st.booleans(),
    }
    return st.builds(
        lambda temperature, top_k, stops, ignore_eos, extra: generate_pb2.SamplingParams(
            temperature=temperature, top_k=top_k, stop_token_ids=stops, ignore_eos=ignore_eos,
            **extra),
        st.one_of(floats, st.floats(0, 2, width=32)), st.integers(-(2**31), 2**31 - 1),
        st.lists(st.one_of(st.integers(0, 300), U32), max_size=3), st.booleans(),
        st.fixed_dictionaries({}, optional=optional))


def requests() -> st.SearchStrategy[generate_pb2.GenerateRequest]:
    prompt = st.one_of(
        st.lists(st.one_of(st.text(max_size=12), st.just("<image>"), st.just("<imag")),
                 max_size=6).map("".join),
        st.just("x" * 5000))
    return st.builds(
        lambda p, images, s, salt, rid: generate_pb2.GenerateRequest(
            prompt=p, images=images, sampling=s, cache_salt=salt, request_id=rid),
        prompt, st.lists(media(), max_size=9), sampling(), st.text(max_size=6),
        st.one_of(st.just(""), st.text(max_size=6)))


def plausible_requests() -> st.SearchStrategy[generate_pb2.GenerateRequest]:
    """Requests that are valid, or nearly so, so that many reach the workers."""
    def build(text: str, n: int, uuid: bool, s: generate_pb2.SamplingParams,
              salt: str) -> generate_pb2.GenerateRequest:
        images = [generate_pb2.MediaItem(encoded=GOOD[i % 2], **({"uuid": f"g{i % 2}"}
                                                                 if uuid else {}))
                  for i in range(n)]
        return generate_pb2.GenerateRequest(prompt=text + " <image>" * n, images=images,
                                            sampling=s, cache_salt=salt)

    valid_sampling = st.builds(
        generate_pb2.SamplingParams, max_tokens=st.integers(1, 4),
        temperature=st.floats(0, 2, width=32), top_p=st.floats(0.25, 1.0, width=32),
        top_k=st.integers(-1, 50), seed=st.integers(0, 2**64 - 1),
        stop_token_ids=st.lists(st.integers(0, 259), max_size=2), ignore_eos=st.booleans(),
        presence_penalty=st.floats(-2, 2, width=32), frequency_penalty=st.floats(-2, 2, width=32),
        repetition_penalty=st.floats(0.5, 2, width=32), min_p=st.floats(0, 1, width=32),
        min_tokens=st.integers(0, 4), logprobs=st.booleans(), top_logprobs=st.integers(0, 20),
        stop=st.lists(st.text(min_size=1, max_size=3), max_size=2),
        include_stop_str_in_output=st.booleans())
    return st.builds(build, st.text(min_size=1, max_size=20), st.integers(0, 3), st.booleans(),
                     valid_sampling, st.sampled_from(["", "t1"]))


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cell]:
    with running_cell(tmp_path_factory.mktemp("fuzz-generate")) as c:
        yield c


def _prefix_state(cell: Cell) -> tuple[int, int]:
    s = cell.stats()
    return s.prefix_cache_hit_tokens_total, s.prefix_cache_blocks


def test_generate_survives_arbitrary_requests(cell: Cell) -> None:
    seen: dict[str, int] = {}

    @settings(max_examples=120, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(msg=st.one_of(requests(), plausible_requests()))
    def run(msg: generate_pb2.GenerateRequest) -> None:
        before = _prefix_state(cell)
        try:
            last = list(cell.stub.Generate(msg, timeout=60))[-1]
            code = "OK"
            assert last.finish_reason != 0 and last.HasField("usage")
        except grpc.RpcError as exc:
            code = exc.code().name
            assert code in ALLOWED, (code, exc.details())
            assert exc.details() and "Traceback" not in exc.details()
            assert _prefix_state(cell) == before, "a rejected request touched the prefix cache"
        seen[code] = seen.get(code, 0) + 1
        stats = cell.stats()
        assert stats.shm_unacked_refs == 0 and stats.kv_blocks_free == stats.kv_blocks_total

    run()
    assert seen.get("INVALID_ARGUMENT", 0) > 10 and seen.get("OK", 0) > 3, seen
    assert cell.generate("still serving", max_tokens=2)[2].usage.completion_tokens == 2
