"""A worker in a real subprocess, driven over its gRPC Unix socket by a client playing the
scheduler, with images delivered as address items written by a real ShmWriter.

Checks: the encoder runs once per new item and not for an item the prefix covers; every
address item is acknowledged (the writer can reclaim the whole segment afterwards); a
prefix-cached request generates the same tokens as the cold one; bad steps get a clear
status and the worker keeps serving; SIGTERM stops it cleanly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from multiprocessing.process import BaseProcess
from pathlib import Path

import grpc
import pytest
from workers import running_worker

from tandem.errors import error_info
from tandem.feature_codec import item_to_parts
from tandem.shm import ShmWriter
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem_testing.scripted import (
    ScriptedRequest,
    ScriptedScheduler,
    synthetic_image,
    synthetic_prompt,
)
from worker_svc.config import WorkerConfig
from worker_svc.model_config import PRESETS
from worker_svc.step import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    StepInput,
    StepOutput,
)
from worker_svc.step_codec import step_output_from_proto, step_to_proto

BLOCK_SIZE = 4
SEGMENT = "features.seg"
CAPACITY = 1 << 20
CONFIG = PRESETS["tiny-mrope"]
IMAGES = [("img-a", synthetic_image(CONFIG, 4, 6, seed=1)),
          ("img-b", synthetic_image(CONFIG, 6, 4, seed=2))]
# 27 tokens: image a at [7, 13), image b at [20, 26); a 24-token prefix hit covers a only.
TOKENS, FEATURES = synthetic_prompt(CONFIG, ["Look: ", " and it", "?"], IMAGES)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[tuple[WorkerConfig, BaseProcess, worker_pb2_grpc.WorkerStub]]:
    shm_dir = tmp_path_factory.mktemp("shm")
    config = WorkerConfig(shm_dir=str(shm_dir), model="tiny-mrope", block_size=BLOCK_SIZE,
                          kv_cache_bytes=4 << 20)
    with running_worker(config) as (proc, channel):
        yield config, proc, worker_pb2_grpc.WorkerStub(channel)


def _step_fn(stub: worker_pb2_grpc.WorkerStub) -> Callable[[StepInput], StepOutput]:
    def step(s: StepInput) -> StepOutput:
        return step_output_from_proto(stub.Step(step_to_proto(s), timeout=60))
    return step


def _rpc_error(stub: worker_pb2_grpc.WorkerStub, step: StepInput) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stub.Step(step_to_proto(step), timeout=60)
    return info.value


def test_shm_features_encoder_runs_and_acks(worker) -> None:
    config, _proc, stub = worker
    describe = stub.Describe(worker_pb2.DescribeRequest(), timeout=30)
    assert (describe.block_size, describe.rank, describe.dtype) == (BLOCK_SIZE, 0, "float32")
    assert describe.num_kv_blocks == (4 << 20) // CONFIG.kv_bytes_per_block(BLOCK_SIZE, 4)
    writer = ShmWriter(Path(config.shm_dir) / SEGMENT, CAPACITY, n_readers=1,
                       max_object_size=CAPACITY)
    try:
        sched = ScriptedScheduler(BLOCK_SIZE, SEGMENT, writer.generation)
        sent = [replace(f, data=writer.put(key, item_to_parts(item)))
                for f, (key, item) in zip(FEATURES, IMAGES, strict=True)]
        cold = ScriptedRequest("cold", TOKENS, sent, max_new_tokens=5)
        outs = sched.run(_step_fn(stub), [cold])
        assert sum(o.encoder_runs for o in outs) == 2
        assert (sum(o.shm_resolved for o in outs), sum(o.shm_acked for o in outs)) == (2, 2)
        assert writer.stats().unacked_refs == 0

        hit = (len(TOKENS) - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert [f.is_covered(hit) for f in FEATURES] == [True, False]
        again = [replace(f, data=writer.hit(key)) for f, (key, _) in zip(FEATURES, IMAGES,
                                                                          strict=True)]
        warm = ScriptedRequest("warm", TOKENS, again, max_new_tokens=5,
                               prefix_blocks=cold.block_ids[:hit // BLOCK_SIZE],
                               num_computed_tokens=hit)
        outs = sched.run(_step_fn(stub), [warm])
        assert warm.output == cold.output, "a prefix-cache hit must not change the tokens"
        assert sum(o.encoder_runs for o in outs) == 1, "only the uncovered image is encoded"
        # Covered image a: acknowledged, only its keep_on_cpu grid read (M-RoPE).
        assert (sum(o.shm_resolved for o in outs), sum(o.shm_acked for o in outs)) == (1, 2)
        _step_fn(stub)(sched.flush())

        assert writer.stats().unacked_refs == 0
        writer.put("whole-segment", [bytes(CAPACITY - 4096)])  # needs every chunk reclaimed
        writer.check_invariants()
    finally:
        writer.close()


def test_bad_steps_get_clear_status_and_worker_keeps_serving(worker) -> None:
    config, _proc, stub = worker
    sched = ScriptedScheduler(BLOCK_SIZE)
    err = _rpc_error(stub, StepInput(900, cached_requests=[], num_scheduled_tokens={"ghost": 1}))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(err).reason == "SCHEDULED_MISMATCH"

    err = _rpc_error(stub, StepInput(901, cached_requests=[CachedRequestData("ghost", [], 0)],
                                     num_scheduled_tokens={"ghost": 1}))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(err).reason == "UNKNOWN_REQUEST" and "ghost" in err.details()

    plain = [replace(f, data=item) for f, (_, item) in zip(FEATURES, IMAGES, strict=True)]
    req = NewRequestData("far", TOKENS, len(TOKENS), plain, SamplingParams(), [10**6] * 7, 0)
    err = _rpc_error(stub, StepInput(902, new_requests=[req],
                                     num_scheduled_tokens={"far": len(TOKENS)}))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(err).reason == "BLOCK_OUT_OF_RANGE"

    # An address into a segment the writer has since re-created.
    path = Path(config.shm_dir) / "recreated.seg"
    old = ShmWriter(path, CAPACITY, n_readers=1, max_object_size=CAPACITY)
    stale = old.put("img-a", item_to_parts(IMAGES[0][1]))
    old.close()
    with ShmWriter(path, CAPACITY, n_readers=1, max_object_size=CAPACITY) as new:
        feats = [replace(FEATURES[0], data=stale), plain[1]]
        req = NewRequestData("stale", TOKENS, len(TOKENS), feats, SamplingParams(),
                             sched.allocate(7), 0)
        err = _rpc_error(stub, StepInput(903, "recreated.seg", new.generation, [req],
                                         num_scheduled_tokens={"stale": len(TOKENS)},
                                         scheduled_encoder_inputs={"stale": [0, 1]}))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(err).reason.startswith("SHM_")

        # Still serving, and the same segment works with a fresh descriptor.
        fresh = [replace(FEATURES[0], data=new.put("img-a", item_to_parts(IMAGES[0][1]))),
                 plain[1]]
        sched.segment = ("recreated.seg", new.generation)
        ok = ScriptedRequest("after-errors", TOKENS, fresh, max_new_tokens=2)
        outs = sched.run(_step_fn(stub), [ok])
        _step_fn(stub)(sched.flush())
        assert len(ok.output) == 2 and sum(o.shm_acked for o in outs) == 1
        assert new.stats().unacked_refs == 0


def test_sigterm_stops_the_worker(worker) -> None:
    config, proc, _stub = worker
    proc.terminate()  # SIGTERM
    proc.join(20)
    assert proc.exitcode == 0
    assert not config.socket_path.exists()
