"""Property-based fuzzing of the worker's Step message against a running worker process.

Every generated step carries at least one forged SHM descriptor (wrong generation, address
out of range or misaligned, an id or size that names no live object, refs that would
over-acknowledge), mixed with valid descriptors, inline items with odd tensors and random
ids, tokens, blocks and encoder inputs. The worker must answer each with INVALID_ARGUMENT or
FAILED_PRECONDITION, quickly, keep serving, and change no counter: after the run the valid
descriptors are still unacknowledged and a well-formed step consumes them exactly once.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from workers import running_worker

from tandem.errors import error_info
from tandem.feature_codec import descriptor_to_proto, item_to_parts
from tandem.shm import ShmDescriptor, ShmWriter
from tandem.v1 import tensor_pb2, worker_pb2, worker_pb2_grpc
from tandem_testing.scripted import synthetic_image, synthetic_prompt
from worker_svc.config import WorkerConfig
from worker_svc.model_config import PRESETS
from worker_svc.step import NewRequestData, SamplingParams, StepInput
from worker_svc.step_codec import step_to_proto

SEGMENT = "features.seg"
CAPACITY = 1 << 20
BLOCK_SIZE = 4
CONFIG = PRESETS["tiny"]
IMAGES = [(f"img-{i}", synthetic_image(CONFIG, 2, 2 * (i + 1), seed=i)) for i in range(3)]
REJECTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)


@dataclass
class Target:
    stub: worker_pb2_grpc.WorkerStub
    health: health_pb2_grpc.HealthStub
    writer: ShmWriter
    live: list[ShmDescriptor]  # one unacknowledged reference each


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    shm_dir = tmp_path_factory.mktemp("fuzz-shm")
    config = WorkerConfig(shm_dir=str(shm_dir), model="tiny", block_size=BLOCK_SIZE,
                          kv_cache_bytes=2 << 20)
    writer = ShmWriter(shm_dir / SEGMENT, CAPACITY, n_readers=1, max_object_size=CAPACITY)
    try:
        with running_worker(config) as (_, channel):
            health = health_pb2_grpc.HealthStub(channel)
            live = [writer.put(key, item_to_parts(item)) for key, item in IMAGES]
            yield Target(worker_pb2_grpc.WorkerStub(channel), health, writer, live)
    finally:
        writer.close()


def _is_live(a: worker_pb2.ShmAddress, live: list[ShmDescriptor]) -> bool:
    return any((a.generation, a.address, a.monotonic_id, a.nbytes)
               == (d.generation, d.address, d.monotonic_id, d.nbytes) and a.refs == 1
               for d in live)


def forged_addresses(live: list[ShmDescriptor]) -> st.SearchStrategy[worker_pb2.ShmAddress]:
    """Descriptors that name no object with a reference outstanding for this reader."""
    def tweak(d: ShmDescriptor, **changes: int) -> worker_pb2.ShmAddress:
        return descriptor_to_proto(replace(d, **changes))

    base = st.sampled_from(live)
    forged = st.one_of(
        base.flatmap(lambda d: U64.map(lambda g: tweak(d, generation=g))),
        base.flatmap(lambda d: st.one_of(st.integers(CAPACITY - 64, 2**64 - 1),
                                         st.integers(0, CAPACITY)).map(
            lambda a: tweak(d, address=a))),
        base.flatmap(lambda d: U64.map(lambda i: tweak(d, monotonic_id=i))),
        base.flatmap(lambda d: st.one_of(st.just(0), st.integers(2, 2**32 - 1)).map(
            lambda r: tweak(d, refs=r))),
        base.flatmap(lambda d: U64.map(lambda n: tweak(d, nbytes=n))),
    )
    return forged.filter(lambda a: not _is_live(a, live))


def tensors() -> st.SearchStrategy[tensor_pb2.Tensor]:
    return st.builds(tensor_pb2.Tensor,
                     dtype=st.sampled_from(["float32", "int64", "uint8", "float64", "", "x"]),
                     shape=st.lists(st.integers(-2, 700), max_size=3),
                     data=st.binary(max_size=64))


def features(live: list[ShmDescriptor]) -> st.SearchStrategy[worker_pb2.Feature]:
    item = st.builds(worker_pb2.FeatureItem, fields=st.lists(st.builds(
        worker_pb2.FeatureField, name=st.sampled_from(["pixel_values", "image_grid_thw", "z"]),
        tensor=tensors(), keep_on_cpu=st.booleans()), max_size=2))
    valid = st.sampled_from(live).map(descriptor_to_proto)
    data = st.one_of(st.none(), item.map(lambda i: {"item": i}),
                     forged_addresses(live).map(lambda a: {"shm": a}),
                     valid.map(lambda a: {"shm": a}))
    return st.builds(lambda ident, off, n, d: worker_pb2.Feature(
        identifier=ident, modality="image", offset=off, length=n, **(d or {})),
        st.sampled_from(["img-0", "img-1", "x", ""]), st.integers(0, 30), st.integers(0, 8),
        data)


@st.composite
def well_formed_steps(draw: st.DrawFn, live: list[ShmDescriptor]) -> worker_pb2.StepRequest:
    """A step that passes every check before the descriptors are resolved: valid and forged
    descriptors in random order, so a valid one may be read before a forged one fails."""
    data = [descriptor_to_proto(d) for d in live]
    data[draw(st.integers(0, 2))] = draw(forged_addresses(live))
    return _well_formed(data, draw(st.permutations(range(3))), live[0].generation,
                        draw(st.sampled_from("ab")))


def _well_formed(data: list, order: list[int], generation: int,
                 rid: str = "a") -> worker_pb2.StepRequest:
    """Request ``rid`` with the three images, image k carrying ``data[order[k]]``."""
    tokens, feats = synthetic_prompt(CONFIG, ["Look: ", " and ", " and ", "?"], IMAGES)
    data = [descriptor_to_proto(d) if isinstance(d, ShmDescriptor) else d for d in data]
    msg = worker_pb2.StepRequest(step_id=1, segment_name=SEGMENT,
                                 segment_generation=generation)
    req = msg.new_requests.add(request_id=rid, token_ids=tokens, num_prompt_tokens=len(tokens),
                               block_ids=range(-(-len(tokens) // BLOCK_SIZE)))
    for f, i in zip(feats, order, strict=True):
        req.features.add(identifier=f.identifier, modality="image", offset=f.mm_position.offset,
                         length=f.mm_position.length, shm=data[i])
    msg.num_scheduled_tokens[rid] = len(tokens)
    msg.scheduled_encoder_inputs[rid].feature_indices.extend([0, 1, 2])
    return msg


@st.composite
def steps(draw: st.DrawFn, live: list[ShmDescriptor]) -> worker_pb2.StepRequest:
    """Anything, with at least one forged descriptor."""
    gen = live[0].generation
    msg = worker_pb2.StepRequest(
        step_id=draw(U64), segment_name=draw(st.sampled_from([SEGMENT, SEGMENT, "", "nope"])),
        segment_generation=draw(st.sampled_from([gen, gen, 0]) | U64))
    ids = draw(st.lists(st.sampled_from(["a", "b", "c", ""]), min_size=1, max_size=3))
    for i, rid in enumerate(ids):
        feats = draw(st.lists(features(live), max_size=3))
        if i == 0:  # at least one forged descriptor per step
            forged = worker_pb2.Feature(identifier="f", modality="image", offset=1, length=1,
                                        shm=draw(forged_addresses(live)))
            feats.insert(draw(st.integers(0, len(feats))), forged)
        msg.new_requests.add(
            request_id=rid, token_ids=draw(st.lists(st.integers(0, 300), max_size=20)),
            num_prompt_tokens=draw(st.integers(0, 24)), features=feats,
            block_ids=draw(st.lists(st.one_of(st.integers(0, 8), U32), max_size=6)),
            num_computed_tokens=draw(st.integers(0, 24)))
        if draw(st.booleans()):
            msg.num_scheduled_tokens[rid] = draw(st.integers(0, 30))
        if draw(st.booleans()):
            msg.scheduled_encoder_inputs[rid].feature_indices.extend(
                draw(st.lists(st.integers(0, 4), max_size=3)))
    for rid in draw(st.lists(st.sampled_from(["a", "z"]), max_size=2)):
        msg.cached_requests.add(request_id=rid, new_block_ids=draw(st.lists(U32, max_size=2)),
                                num_computed_tokens=draw(st.integers(0, 30)))
    msg.finished_request_ids.extend(draw(st.lists(st.sampled_from(["a", "q"]), max_size=2)))
    msg.free_encoder_mm_hashes.extend(draw(st.lists(st.sampled_from(["img-0", "w"]),
                                                    max_size=2)))
    return msg


def _unacked(target: Target) -> int:
    return target.writer.stats().unacked_refs


def test_a_descriptor_repeated_within_a_step_is_refused(target: Target) -> None:
    """Two references would be acknowledged where one was issued: the whole step is refused
    before anything is acknowledged."""
    step = _well_formed(target.live, [0, 0, 2], target.live[0].generation)
    with pytest.raises(grpc.RpcError) as err:
        target.stub.Step(step, timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(err.value).reason == "SHM_STALE_DESCRIPTOR"
    assert "generation" not in err.value.details(), "the store's text stays in the log"
    assert _unacked(target) == len(target.live)


def test_integer_pixels_are_refused_before_anything_changes(target: Target) -> None:
    """Pixels of the right shape but an integer dtype would fail in the encoder, after the
    commit point; they must be refused with the checks."""
    tokens, feats = synthetic_prompt(CONFIG, ["Look: ", "?"], IMAGES[:1])
    step = StepInput(1, new_requests=[NewRequestData(
        "ints", tokens, len(tokens), feats, SamplingParams(), [0, 1, 2], 0)],
        num_scheduled_tokens={"ints": len(tokens)}, scheduled_encoder_inputs={"ints": [0]})
    msg = step_to_proto(step)
    pixels = msg.new_requests[0].features[0].item.fields[0].tensor
    assert pixels.dtype == "float32"
    pixels.dtype, pixels.data = "int32", pixels.data  # same size, integer elements
    with pytest.raises(grpc.RpcError) as err:
        target.stub.Step(msg, timeout=30)
    assert error_info(err.value).reason == "BAD_PIXELS"
    out = target.stub.Step(step_to_proto(step), timeout=30)  # "ints" was not admitted
    assert list(out.sampled) == ["ints"]
    target.stub.Step(step_to_proto(StepInput(2, finished_request_ids=["ints"],
                                             free_encoder_mm_hashes=["img-0"])), timeout=30)


@pytest.fixture(scope="module")
def fuzzed(target: Target) -> Target:
    """Run the fuzzing once; the tests below check what it left behind."""
    assert _unacked(target) == len(target.live)
    reasons: Counter[str] = Counter()

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        msg = data.draw(st.one_of(steps(target.live), well_formed_steps(target.live)))
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            target.stub.Step(msg, timeout=30)
        assert err.value.code() in REJECTED, (err.value.code(), err.value.details())
        assert time.monotonic() - start < 10
        assert _unacked(target) == len(target.live), "a rejected step acknowledged something"
        reasons[error_info(err.value).reason] += 1

    run()
    # The fuzzing got past the structural checks to the descriptors often enough.
    assert sum(n for r, n in reasons.items() if r.startswith("SHM_")) >= 30, reasons
    return target


def test_rejected_steps_change_no_counter(fuzzed: Target) -> None:
    resp = fuzzed.health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    fuzzed.writer.check_invariants()
    # A well-formed step takes each outstanding reference exactly once; a request id the
    # fuzzer used ("a") is free: no rejected step admitted it.
    tokens, feats = synthetic_prompt(CONFIG, ["Look: ", " and ", " and ", "?"], IMAGES)
    feats = [replace(f, data=d) for f, d in zip(feats, fuzzed.live, strict=True)]
    blocks = list(range(-(-len(tokens) // BLOCK_SIZE)))
    step = StepInput(1, SEGMENT, fuzzed.live[0].generation,
                     [NewRequestData("a", tokens, len(tokens), feats, SamplingParams(), blocks, 0)],
                     num_scheduled_tokens={"a": len(tokens)},
                     scheduled_encoder_inputs={"a": [0, 1, 2]})
    out = fuzzed.stub.Step(step_to_proto(step), timeout=30)
    assert (out.shm_resolved, out.shm_acked, out.encoder_runs) == (3, 3, 3)
    assert list(out.sampled) == ["a"]
    assert _unacked(fuzzed) == 0
    fuzzed.writer.check_invariants()
