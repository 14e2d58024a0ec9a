"""The worker server in-process: health around warm-up and shutdown, health answering while a
step runs, Describe, reflection, the Unix socket's mode, the extra TCP listener, and the
health-only port (health answers there, the Worker API does not), and the Steps stream."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from scheduler_svc.worker_client import StepFailed, WorkerPool
from tandem.feature_codec import descriptor_to_proto, item_to_parts
from tandem.shm import ShmDescriptor, ShmWriter
from tandem.text.byte_tokenizer import BOS_ID
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem_testing.scripted import synthetic_image, synthetic_prompt
from worker_svc.config import WorkerConfig
from worker_svc.model_config import PRESETS
from worker_svc.server import SERVICE_NAME, RunningWorker, create_server, shutdown
from worker_svc.step import NewRequestData, SamplingParams, StepInput
from worker_svc.step_codec import step_to_proto

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG_PROMPT = 3072  # its prefill (~1 s) outlasts many health round trips (~1 ms)


async def _health(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


async def _list_services(channel: grpc.aio.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]))
    async for resp in call:
        return {s.name for s in resp.list_services_response.service}
    return set()


async def _scenario(tmp_path: Path) -> None:
    config = WorkerConfig(shm_dir=str(tmp_path / "cell"), block_size=16,
                          kv_cache_bytes=32 << 20, worker_listen="127.0.0.1:0")
    worker = await create_server(config)
    try:
        unix, tcp = worker.addresses
        assert unix == f"unix://{config.socket_path}" and tcp.startswith("127.0.0.1:")
        assert stat.S_IMODE(os.stat(config.socket_path).st_mode) == 0o600
        async with grpc.aio.insecure_channel(tcp) as channel:
            if not worker.warmup.done():
                assert await _health(channel) == NOT_SERVING
            stub = worker_pb2_grpc.WorkerStub(channel)
            describe = await stub.Describe(worker_pb2.DescribeRequest(), timeout=60)
            assert await _health(channel) == SERVING
            assert await _health(channel, SERVICE_NAME) == SERVING
            assert (describe.model, describe.device, describe.block_size) == ("tiny", "cpu", 16)
            assert describe.segment_generation == 0  # no segment named yet
            assert describe.num_kv_blocks > 0
            assert {SERVICE_NAME, "grpc.health.v1.Health"} <= await _list_services(channel)

            tokens = [BOS_ID] + [ord("a") + i % 26 for i in range(LONG_PROMPT - 1)]
            req = NewRequestData("long", tokens, len(tokens), [], SamplingParams(),
                                 list(range(LONG_PROMPT // 16)), 0)
            step = stub.Step(step_to_proto(StepInput(
                1, new_requests=[req], num_scheduled_tokens={"long": LONG_PROMPT})), timeout=60)
            answered_during_step = 0
            while not step.done():
                assert await _health(channel) == SERVING
                answered_during_step += not step.done()
            assert answered_during_step >= 1, "health must answer while a step runs"
            assert list((await step).sampled) == ["long"]
    finally:
        await shutdown(worker)
    assert await worker.grpc.health.Check(health_pb2.HealthCheckRequest(), None) == \
        health_pb2.HealthCheckResponse(status=NOT_SERVING)
    assert not config.socket_path.exists()


def test_health_describe_reflection_and_shutdown(tmp_path: Path) -> None:
    asyncio.run(_scenario(tmp_path))


async def _health_port_scenario(tmp_path: Path) -> None:
    config = WorkerConfig(shm_dir=str(tmp_path / "cell"), block_size=16,
                          kv_cache_bytes=32 << 20, health_listen="127.0.0.1:0")
    worker = await create_server(config)
    try:
        assert worker.addresses == [f"unix://{config.socket_path}"], "no Worker API on TCP"
        assert worker.grpc.probes is not None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.grpc.probes.port}") as channel:
            await worker.warmup
            assert await _health(channel) == SERVING
            assert await _health(channel, SERVICE_NAME) == SERVING
            stub = worker_pb2_grpc.WorkerStub(channel)
            for call in (stub.Describe(worker_pb2.DescribeRequest(), timeout=5),
                         stub.Step(step_to_proto(StepInput(1)), timeout=5)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _list_services(channel)  # not even reflection reveals the Worker API
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await shutdown(worker)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.grpc.probes.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _health(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, "closed on shutdown"


def test_health_port_serves_health_and_refuses_the_worker_api(tmp_path: Path) -> None:
    asyncio.run(_health_port_scenario(tmp_path))


@contextlib.asynccontextmanager
async def _worker_stub(tmp_path: Path) -> AsyncIterator[worker_pb2_grpc.WorkerStub]:
    """A warmed-up worker on ``tmp_path``'s cell directory, and a stub on its socket."""
    config = WorkerConfig(shm_dir=str(tmp_path / "cell"), block_size=16,
                          kv_cache_bytes=32 << 20)
    worker = await create_server(config)
    try:
        await worker.warmup
        async with grpc.aio.insecure_channel(worker.addresses[0]) as channel:
            yield worker_pb2_grpc.WorkerStub(channel)
    finally:
        await shutdown(worker)


async def _steps_scenario(tmp_path: Path) -> None:
    async with _worker_stub(tmp_path) as stub:
        tokens = [BOS_ID] + [ord("a") + i for i in range(20)]

        def prefill(step_id: int, rid: str) -> worker_pb2.StepsRequest:
            req = NewRequestData(rid, tokens, len(tokens), [], SamplingParams(), [0, 1], 0)
            return worker_pb2.StepsRequest(step=step_to_proto(StepInput(
                step_id, new_requests=[req], num_scheduled_tokens={rid: len(tokens)})))

        def decode(step_id: int, rid: str, computed: int) -> worker_pb2.StepsRequest:
            msg = step_to_proto(StepInput(step_id, num_scheduled_tokens={rid: 1}))
            msg.cached_requests.add(request_id=rid, num_computed_tokens=computed)
            return worker_pb2.StepsRequest(step=msg)

        # Three steps written before any answer: the decodes take the sampled token
        # from the step before them, on the worker.
        call = stub.Steps()
        for msg in (prefill(1, "a"), decode(2, "a", 21), decode(3, "a", 22)):
            await call.write(msg)
        answers = [await call.read() for _ in range(3)]
        assert [a.step_id for a in answers] == [1, 2, 3]
        assert [a.WhichOneof("outcome") for a in answers] == ["done"] * 3
        assert all(len(a.done.sampled["a"].token_ids) == 1 for a in answers)
        # A step the worker refuses (it counts 23 computed tokens, not 30) is answered
        # with its error; the step written behind it is not run, the stream stays open.
        for msg in (decode(4, "a", 30), decode(5, "a", 23)):
            await call.write(msg)
        refused, behind = await call.read(), await call.read()
        assert refused.WhichOneof("outcome") == "error"
        assert (refused.error.code, refused.error.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION.value[0], "COMPUTED_MISMATCH")
        assert behind.step_id == 5 and behind.not_run
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        # A new stream: step 5 runs now, on the state the refused step left alone.
        call = stub.Steps()
        await call.write(decode(5, "a", 23))
        assert (await call.read()).WhichOneof("outcome") == "done"
        # A step that cannot even be decoded is answered the same way, in its turn.
        bad = prefill(6, "b")
        field = bad.step.new_requests[0].features.add(
            identifier="x", modality="image", offset=1, length=1).item.fields.add(
            name="pixel_values")
        field.tensor.dtype = "complex7"
        for msg in (bad, decode(7, "a", 24)):
            await call.write(msg)
        undecodable, behind = await call.read(), await call.read()
        assert (undecodable.step_id, undecodable.error.code) == (
            6, grpc.StatusCode.INVALID_ARGUMENT.value[0])
        assert "complex7" in undecodable.error.message and behind.not_run
        call.cancel()


def test_steps_stream_runs_in_order_and_stops_at_a_failed_step(tmp_path: Path) -> None:
    """The scheduler's step stream (worker.proto, Steps): steps written ahead run in order
    and are answered in order; a failed step is answered with its status and the steps
    behind it are not run; a new stream carries on."""
    asyncio.run(_steps_scenario(tmp_path))


async def _deferred_masks_scenario(tmp_path: Path) -> None:
    async with _worker_stub(tmp_path) as stub:
        tokens = [BOS_ID, ord("a"), ord("b")]
        only_z = (1 << (ord("z") % 32)).to_bytes(4, "little")
        only_z = bytes(4 * (ord("z") // 32)) + only_z  # the words before z's are 0
        msg = step_to_proto(StepInput(1, new_requests=[NewRequestData(
            "a", tokens, 3, [], SamplingParams(), [0], 0)], num_scheduled_tokens={"a": 3}))
        msg.deferred_mask_ids.append("a")
        with pytest.raises(grpc.aio.AioRpcError) as unary:  # no stream, no masks to come
            await stub.Step(msg, timeout=30)
        assert unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        call = stub.Steps()
        await call.write(worker_pb2.StepsRequest(step=msg))
        await call.write(worker_pb2.StepsRequest(masks=worker_pb2.StepMasks(
            step_id=1, token_masks={"a": only_z})))
        answer = await asyncio.wait_for(call.read(), 30)
        assert list(answer.done.sampled["a"].token_ids) == [ord("z")]
        # The scheduler leaves without sending a step's masks: the step fails (not a
        # refusal: the worker had committed to it) and nothing waits for good.
        decode = step_to_proto(StepInput(2, num_scheduled_tokens={"a": 1}))
        decode.cached_requests.add(request_id="a", num_computed_tokens=3)
        decode.deferred_mask_ids.append("a")
        await call.write(worker_pb2.StepsRequest(step=decode))
        await call.done_writing()
        failed = await asyncio.wait_for(call.read(), 30)
        assert (failed.error.code, failed.error.reason) == (
            grpc.StatusCode.UNAVAILABLE.value[0], "MASKS_NOT_SENT")


def test_deferred_token_masks_are_waited_for_until_they_come_or_the_stream_ends(
        tmp_path: Path) -> None:
    """Structured output under asynchronous scheduling (worker.proto deferred_mask_ids):
    the worker samples with masks sent after the step, refuses them on the unary Step, and
    a stream that ends without them fails the step rather than hanging the step thread."""
    asyncio.run(_deferred_masks_scenario(tmp_path))


async def _late_step_scenario(tmp_path: Path) -> None:
    config = WorkerConfig(shm_dir=str(tmp_path / "cell"), block_size=16,
                          kv_cache_bytes=32 << 20)
    worker = await create_server(config)
    pool = WorkerPool(worker.addresses)
    try:
        await worker.warmup
        unknown = step_to_proto(StepInput(1, num_scheduled_tokens={"ghost": 1}))
        unknown.cached_requests.add(request_id="ghost", num_computed_tokens=3)
        failed = await pool.send(unknown)
        await asyncio.wait(failed.futures)  # its answer is in before the next step is sent
        tokens = [BOS_ID, ord("a"), ord("b")]
        prefill = step_to_proto(StepInput(2, new_requests=[NewRequestData(
            "p", tokens, 3, [], SamplingParams(), [0], 0)], num_scheduled_tokens={"p": 3}))
        late = await pool.send(prefill)
        with pytest.raises(StepFailed) as first:
            await pool.result(failed, 30)
        assert first.value.refused and first.value.failures[0].code == (
            grpc.StatusCode.FAILED_PRECONDITION)
        with pytest.raises(StepFailed) as second:
            await pool.result(late, 30)
        assert second.value.not_run, "a step sent after a failed one must not run"
        pool.end_streams()  # the scheduler dealt with the failure
        assert list((await pool.result(await pool.send(prefill), 30)).sampled) == ["p"]
    finally:
        await pool.close()
        await shutdown(worker)


def test_a_step_sent_after_a_failed_one_is_not_run_until_the_streams_are_renewed(
        tmp_path: Path) -> None:
    """The scheduler's pool (scheduler_svc.worker_client) against a real worker: once a
    step failed, the steps sent after it were built on its effects, so they fail as not
    run, even when the failure was known before they were sent, until the engine renews
    the streams."""
    asyncio.run(_late_step_scenario(tmp_path))


Prefill = Callable[[int, str, ShmDescriptor], worker_pb2.StepRequest]


@contextlib.asynccontextmanager
async def _worker_on_a_segment(tmp_path: Path) -> AsyncIterator[
        tuple[RunningWorker, ShmWriter, ShmDescriptor, Prefill]]:
    """A warmed-up worker; a real segment (one reader slot) holding image "img" and the
    put's reference to it; ``prefill(step_id, rid, descriptor)``: the step of a new
    request showing it."""
    config = WorkerConfig(shm_dir=str(tmp_path / "cell"), block_size=16,
                          kv_cache_bytes=32 << 20)
    worker = await create_server(config)
    writer = ShmWriter(tmp_path / "cell" / "features.seg", 1 << 20, n_readers=1,
                       max_object_size=1 << 20)
    try:
        await worker.warmup
        image = synthetic_image(PRESETS["tiny"], 2, 2, seed=3)
        tokens, [feature] = synthetic_prompt(PRESETS["tiny"], ["Look: ", "?"],
                                             [("img", image)])
        first = writer.put("img", item_to_parts(image))

        def prefill(step_id: int, rid: str, data: ShmDescriptor) -> worker_pb2.StepRequest:
            req = NewRequestData(rid, tokens, len(tokens), [replace(feature, data=data)],
                                 SamplingParams(), [0, 1], 0)
            return step_to_proto(StepInput(
                step_id, "features.seg", writer.generation, new_requests=[req],
                num_scheduled_tokens={rid: len(tokens)}, scheduled_encoder_inputs={rid: [0]}))

        yield worker, writer, first, prefill
        writer.check_invariants()
    finally:
        writer.close()
        await shutdown(worker)


async def _not_run_scenario(tmp_path: Path) -> None:
    async with _worker_on_a_segment(tmp_path) as (worker, writer, first, step):
        second = writer.hit("img")  # the same chunk twice in one step: 2 refs on the slot

        def prefill(step_id: int, rid: str, data: ShmDescriptor) -> worker_pb2.StepsRequest:
            return worker_pb2.StepsRequest(step=step(step_id, rid, data))

        unknown = step_to_proto(StepInput(1, num_scheduled_tokens={"ghost": 1}))
        unknown.cached_requests.add(request_id="ghost", num_computed_tokens=3)
        async with grpc.aio.insecure_channel(worker.addresses[0]) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Steps()
            for msg in (worker_pb2.StepsRequest(step=unknown), prefill(2, "a", first),
                        prefill(3, "b", second), prefill(4, "c", first)):
                await call.write(msg)
            answers = [await call.read() for _ in range(4)]
            assert answers[0].WhichOneof("outcome") == "error"
            assert [a.not_run for a in answers[1:]] == [True] * 3
            # Steps 2 and 3 acknowledged their references on the worker's slot, as if run;
            # step 4 repeats step 2's descriptor, which would over-acknowledge: none of it.
            assert writer.outstanding() == {}
            assert writer.stats().unacked_refs == 0
            call.cancel()
            # Nothing else changed: the not-run requests are unknown to the worker.
            call = worker_pb2_grpc.WorkerStub(channel).Steps()
            again = worker_pb2.StepsRequest(step=unknown)
            again.step.step_id, again.step.cached_requests[0].request_id = 5, "a"
            again.step.num_scheduled_tokens.clear()
            again.step.num_scheduled_tokens["a"] = 1
            await call.write(again)
            assert (await call.read()).error.reason == "UNKNOWN_REQUEST"
            call.cancel()


def test_a_step_not_run_acknowledges_its_address_items(tmp_path: Path) -> None:
    """A step the worker answers not_run (here: queued behind a failed one) acknowledges its
    address items on the worker's own reader slot, reading nothing and changing nothing
    else: the scheduler holds such a step's references in doubt on that slot, and only the
    worker may write its slot, so without it they would stay unacknowledged for good
    (issue 22, item 5)."""
    asyncio.run(_not_run_scenario(tmp_path))


async def _unseen_scenario(tmp_path: Path) -> None:
    async with _worker_on_a_segment(tmp_path) as (worker, writer, first, prefill):
        ran = prefill(1, "a", first)

        def unseen(*steps: tuple[int, list[object]]) -> worker_pb2.AcknowledgeRequest:
            return worker_pb2.AcknowledgeRequest(
                segment_name="features.seg", segment_generation=writer.generation,
                steps=[worker_pb2.UnseenStep(step_id=i, items=[
                    descriptor_to_proto(d) for d in descs]) for i, descs in steps])

        async with grpc.aio.insecure_channel(worker.addresses[0]) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            assert (await stub.Describe(worker_pb2.DescribeRequest())).last_step_id == 0
            call = stub.Steps()
            await call.write(worker_pb2.StepsRequest(step=ran))
            answer = await call.read()
            assert answer.WhichOneof("outcome") == "done", answer
            described = await stub.Describe(worker_pb2.DescribeRequest())
            assert (described.last_step_id, described.last_step_generation) == (
                1, writer.generation)
            second, third = writer.hit("img"), writer.hit("img")
            # While a step stream is open a step may still arrive: Acknowledge waits, and
            # one whose deadline passes meanwhile is dropped, never run later.
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await stub.Acknowledge(unseen((2, [second])), timeout=0.3)
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            waiting = asyncio.ensure_future(stub.Acknowledge(
                unseen((1, [first]), (2, [second]), (3, [third])), timeout=30))
            await asyncio.sleep(0.3)
            assert not waiting.done() and writer.outstanding()
            call.cancel()
            # Step 1 ran here (acknowledged then): only steps 2 and 3 are acknowledged.
            waited = await waiting
            assert (waited.acked, waited.last_step_id) == (2, 3)
            assert writer.outstanding() == {}
            again = await stub.Acknowledge(unseen((2, [second]), (3, [third])), timeout=30)
            assert (again.acked, again.last_step_id) == (0, 3)  # handled already: no-op
            # Checked as a step's items: one descriptor twice over its one outstanding
            # reference acknowledges none of them, and the steps stay unhandled.
            fourth = writer.hit("img")
            with pytest.raises(grpc.aio.AioRpcError) as twice:
                await stub.Acknowledge(unseen((4, [fourth]), (5, [fourth])), timeout=30)
            assert twice.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert writer.stats().unacked_refs == 1
            assert (await stub.Describe(worker_pb2.DescribeRequest())).last_step_id == 3
            assert (await stub.Acknowledge(unseen((4, [fourth])), timeout=30)).acked == 1
        assert writer.stats().unacked_refs == 0


def test_acknowledge_settles_the_address_items_of_steps_the_worker_never_received(
        tmp_path: Path) -> None:
    """Worker.Acknowledge (worker.proto): the scheduler asks a live worker to acknowledge,
    on its own reader slot, the address items of steps a lost stream dropped before they
    reached it. It waits for open step streams, skips the steps the worker took up (Describe
    reports the last one), checks the items as a step's, all or none (issue 22, item 5)."""
    asyncio.run(_unseen_scenario(tmp_path))
