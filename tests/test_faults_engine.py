"""The scheduler's engine against a real worker process, with faults a cell meets: a worker
stopped (SIGSTOP) for longer than the step timeout, a step refused by a healthy worker, an
unexpected error in the engine loop (and what the workers are told after it), a stray
reply on a step stream, and shutdown while a worker is unreachable.

The engine, its processor cache (a real segment) and a fault-injecting relay run in the
test's event loop; the worker is a spawned ``worker_svc`` process reached over its Unix
socket. The relay forwards every call unchanged except the ones a test tells it to refuse,
answering those as a healthy worker refusing a step does (a status with an ErrorInfo).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import signal
import struct
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from engines import generate, idle, running_engine, until
from worker_relay import relay
from workers import running_worker

from scheduler_svc.worker_client import WorkerPool
from tandem.errors import TandemError, Unavailable
from tandem.processor_cache import SEGMENT_FILE
from tandem.shm.segment import C_ACKS, C_REFS, HEADER_SIZE
from tandem.v1 import worker_pb2
from tandem_testing.cells import png, request
from worker_svc.config import WorkerConfig

PROMPT = "Look at <image> and say"
STEP_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    """(shared directory, pid) of one worker process for the whole module."""
    shm = tmp_path_factory.mktemp("shm")
    config = WorkerConfig(shm_dir=str(shm), kv_cache_bytes=4 << 20)
    with running_worker(config) as (proc, _):
        yield shm, proc.pid


def chunk_words(shm: Path, address: int = 0) -> tuple[int, int]:
    """(refs issued, ack of slot 0) of the chunk at ``address``, read from the file."""
    with open(shm / SEGMENT_FILE, "rb") as f, mmap.mmap(f.fileno(), 0,
                                                        access=mmap.ACCESS_READ) as m:
        base = HEADER_SIZE + address
        refs, = struct.unpack_from("<Q", m, base + 8 * C_REFS)
        ack, = struct.unpack_from("<Q", m, base + 8 * C_ACKS)
    return refs, ack


def corrupt_ack(shm: Path, value: int, address: int = 0) -> None:
    with open(shm / SEGMENT_FILE, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        struct.pack_into("<Q", m, HEADER_SIZE + address + 8 * C_ACKS, value)


def test_a_timed_out_step_leaves_the_slot_of_a_live_worker_alone(worker) -> None:
    """Fault 1: a worker stopped past the step timeout is alive; its step may still run and
    acknowledge, so the writer must not write its ack slot."""
    shm, pid = worker

    async def main() -> None:
        async with running_engine(shm, step_timeout_s=STEP_TIMEOUT_S) as e:
            msg = request(PROMPT, [png(1)], max_tokens=4)
            reference = await generate(e, msg)
            await idle(e)
            assert chunk_words(shm) == (1, 1)
            os.kill(pid, signal.SIGSTOP)
            try:
                with pytest.raises(Unavailable):
                    await generate(e, msg)
                refs, ack = chunk_words(shm)
                assert (refs, ack) == (2, 1), "the stopped worker's ack slot was written"
            finally:
                os.kill(pid, signal.SIGCONT)
            await until(lambda: e.serving)
            assert await generate(e, msg) == reference
            await until(lambda: e.cache_stats().shm_unacked_refs == 0)
            e.check_invariants()

    asyncio.run(main())


def test_in_doubt_references_settle_without_further_traffic(worker) -> None:
    """The step carrying an image times out on a stopped worker: its references are in
    doubt. Once the worker answers again, the cell, with no request to run, still settles
    them (the step carrying the lost requests' releases goes out by itself), so an idle
    cell does not report unacknowledged references (the operator's ReferencesLeaking)."""
    shm, pid = worker

    async def main() -> None:
        async with running_engine(shm, step_timeout_s=STEP_TIMEOUT_S) as e:
            os.kill(pid, signal.SIGSTOP)
            try:
                with pytest.raises(Unavailable):
                    await generate(e, request(PROMPT, [png(6)], max_tokens=4))
                assert e.ledger_stats().in_doubt > 0 and e.cache_stats().shm_unacked_refs > 0
            finally:
                os.kill(pid, signal.SIGCONT)
            await until(lambda: e.serving)
            await until(lambda: e.cache_stats().shm_unacked_refs == 0, timeout=5)
            assert e.ledger_stats().refs == 0
            e.check_invariants()

    asyncio.run(main())


def test_a_step_refused_by_a_healthy_worker_fails_only_its_requests(worker, tmp_path) -> None:
    """Fault 6: INVALID_ARGUMENT is the worker's answer about one step's requests, not a
    lost worker: the others keep streaming and the cell keeps serving."""
    shm, _ = worker

    async def main() -> None:
        async with relay(shm / "worker-0.sock", tmp_path / "relay.sock") as r, \
                running_engine(shm, f"unix://{tmp_path}/relay.sock",
                               step_timeout_s=STEP_TIMEOUT_S) as e:
            long = asyncio.create_task(generate(e, request(
                "A long answer", max_tokens=40, ignore_eos=True)))
            await until(lambda: any(e.scheduler.requests.values()))
            r.refuse = lambda step: any(n.request_id == "doomed" for n in step.new_requests)
            doomed = request(PROMPT, [png(2)], max_tokens=4)
            doomed.request_id = "doomed"
            with pytest.raises(TandemError) as err:
                await generate(e, doomed)
            assert err.value.code == grpc.StatusCode.INTERNAL and r.refused == 1
            assert len(await long) == 40
            assert e.serving and e.worker_losses == 0
            await until(lambda: e.cache_stats().shm_unacked_refs == 0)

    asyncio.run(main())


def test_an_unexpected_error_fails_the_requests_then_health(worker, monkeypatch) -> None:
    """Fault 2: an error the loop did not expect (here TANDEM_DEBUG_INVARIANTS finding the
    segment corrupted from outside) fails the requests with INTERNAL instead of ending the
    loop silently; when it happens again right after recovering, the cell stops serving."""
    shm, _ = worker
    monkeypatch.setenv("TANDEM_DEBUG_INVARIANTS", "1")

    async def main() -> None:
        async with running_engine(shm, step_timeout_s=STEP_TIMEOUT_S) as e:
            await generate(e, request(PROMPT, [png(3)], max_tokens=2))
            corrupt_ack(shm, 99)  # more acknowledgements than references: a rogue writer
            for _ in range(2):
                with pytest.raises(TandemError) as err:
                    await asyncio.wait_for(
                        generate(e, request("Text only", max_tokens=4, ignore_eos=True)), 20)
                assert err.value.code == grpc.StatusCode.INTERNAL
                assert "internal error" in err.value.message
            assert not e.serving and e.errors == 2
            with pytest.raises(Unavailable):
                await generate(e, request("Text only", max_tokens=4))
            corrupt_ack(shm, 1)

    asyncio.run(main())


def test_a_stray_reply_on_the_step_stream_fails_the_steps_instead_of_hanging(
        worker, tmp_path) -> None:
    """Fault 7: the worker's stream answers a step twice, when no other step is pending.
    The stream's reader must fail what is sent on it after that (the worker is then lost
    and the cell reconnects), never leave a request waiting for an answer for good."""
    shm, _ = worker

    async def main() -> None:
        async with relay(shm / "worker-0.sock", tmp_path / "relay.sock") as r, \
                running_engine(shm, f"unix://{tmp_path}/relay.sock",
                               step_timeout_s=STEP_TIMEOUT_S) as e:
            # the step that only releases the finished request: the last one out
            r.repeat = lambda step: not step.num_scheduled_tokens
            await generate(e, request("Once", max_tokens=1))
            await idle(e)
            r.repeat = lambda _: False
            with pytest.raises(Unavailable):
                await asyncio.wait_for(generate(e, request("Then", max_tokens=2)), 10)
            await until(lambda: e.serving)
            assert len(await generate(e, request("Again", max_tokens=2))) == 2
            assert e.worker_losses == 1 and e.errors == 0

    asyncio.run(main())


def test_a_step_whose_waiter_gave_up_leaves_the_step_stream_working(worker) -> None:
    """Fault 7, the other way a reader could end: the answer of a step whose future was
    cancelled (its waiter gave up) must not end the reader, or the steps behind it hang."""
    shm, _ = worker

    async def main() -> None:
        pool = WorkerPool([f"unix://{shm}/worker-0.sock"])
        try:
            await pool.describe(10)
            first = await pool.send(worker_pb2.StepRequest(step_id=1))
            first.futures[0].cancel()
            second = await pool.send(worker_pb2.StepRequest(step_id=2))
            result = await asyncio.wait_for(pool.result(second, STEP_TIMEOUT_S), 10)
            assert result.sampled == {}
        finally:
            await pool.close()

    asyncio.run(main())


def _worker_holds(steps: list[worker_pb2.StepRequest]) -> tuple[set[str], set[str]]:
    """(request ids, encoder-output hashes) a worker holds after running ``steps`` in
    order: what its step messages told it to create and to drop (worker.proto)."""
    features: dict[str, list[str]] = {}
    encoded: set[str] = set()
    for step in steps:
        for rid in step.finished_request_ids:
            features.pop(rid, None)
        encoded -= set(step.free_encoder_mm_hashes)
        for new in step.new_requests:
            features[new.request_id] = [f.identifier for f in new.features]
        for rid, inputs in step.scheduled_encoder_inputs.items():
            encoded |= {features[rid][i] for i in inputs.feature_indices}
    return set(features), encoded


def test_after_an_unexpected_error_the_workers_drop_what_the_abandoned_steps_released(
        worker) -> None:
    """The loop fails while sending the step that releases request A (cancelled) and
    evicts A's image from the workers' encoder cache to make room for B's: that step
    never reaches the worker. After the recovery the next steps must carry those releases,
    or the worker keeps A's state and A's encoder output for good."""
    shm, _ = worker
    small = {"encoder_cache_embeds": 4, "min_pixels": 56 * 56, "max_pixels": 56 * 56}

    async def main() -> None:
        async with running_engine(shm, step_timeout_s=STEP_TIMEOUT_S, max_num_seqs=2,
                                  **small) as e:
            sent: list[worker_pb2.StepRequest] = []  # every step written to the worker
            abandoned: list[worker_pb2.StepRequest] = []
            send = e.workers.send

            async def failing_send(msg):  # delegates, except for the one step it fails
                if msg.finished_request_ids and msg.free_encoder_mm_hashes and not abandoned:
                    abandoned.append(msg)
                    raise RuntimeError("injected: the step never reaches the worker")
                out = await send(msg)
                sent.append(msg)
                return out

            e.workers.send = failing_send  # type: ignore[method-assign]
            long = asyncio.create_task(generate(e, request(
                "A long answer", max_tokens=60, ignore_eos=True)))
            a = e.generate(request(PROMPT, [png(4, 56, 56)], max_tokens=60, ignore_eos=True))
            await anext(a)
            await anext(a)  # A is running; its image's encoder output is on the worker
            b = asyncio.create_task(generate(e, request(PROMPT, [png(5, 56, 56)],
                                                        max_tokens=4)))
            await until(lambda: len(e.scheduler.waiting) == 1)  # B waits for a seat
            await a.aclose()  # the client leaves A: B takes its seat and A's encoder slot
            for task in (long, b):
                with pytest.raises(TandemError) as err:
                    await asyncio.wait_for(task, 20)
                assert err.value.code == grpc.StatusCode.INTERNAL
            [step] = abandoned
            assert e.errors == 1 and e.serving
            assert await generate(e, request("After the error", max_tokens=2)) != []
            await idle(e)
            requests, encoded = _worker_holds(sent)
            assert requests == set() and encoded == set(), (
                f"the worker keeps {requests} and encoder outputs {encoded}; the abandoned "
                f"step released {list(step.finished_request_ids)} and "
                f"{list(step.free_encoder_mm_hashes)}")
            await until(lambda: e.cache_stats().shm_unacked_refs == 0)

    asyncio.run(main())


def test_stop_awaits_every_task_of_the_engine(worker) -> None:
    """Fault 6: the reconnect loop after a loss is a task the engine keeps and stops."""
    shm, pid = worker

    async def main() -> None:
        async with running_engine(shm, step_timeout_s=STEP_TIMEOUT_S) as e:
            await generate(e, request("Warm", max_tokens=2))
            os.kill(pid, signal.SIGSTOP)
            try:
                with pytest.raises(Unavailable):
                    await generate(e, request("Stuck", max_tokens=2))
                await e.stop()
                await asyncio.sleep(0.1)
                left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                assert left == []
            finally:
                os.kill(pid, signal.SIGCONT)

    asyncio.run(main())


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[int]]]:
    """(shared directory, pids) of two replica workers (reader slots 0 and 1)."""
    shm = tmp_path_factory.mktemp("shm2")
    configs = [WorkerConfig(shm_dir=str(shm), rank=rank, world_size=2, kv_cache_bytes=4 << 20)
               for rank in range(2)]
    with running_worker(configs[0]) as (first, _), running_worker(configs[1]) as (second, _):
        yield shm, [first.pid, second.pid]


def test_after_an_unexpected_error_the_doubts_of_steps_a_worker_never_read_settle(
        two_workers) -> None:
    """Issue 22, items 2 and 5: the loop fails while worker 0 is stopped and worker 1 has
    run the step with the image (acknowledged on slot 1). The recovery ends the step
    streams as a loss does; a step the stopped worker had not read may be dropped then
    (test_faults.py::test_steps_a_stopped_worker_never_read_settle_while_the_cell_is_idle
    has the loss's half), so the recovery settles the doubts as a reconnect does, and
    with no traffic after the error nothing stays held or in doubt."""
    shm, pids = two_workers

    async def main() -> None:
        async with running_engine(shm, workers=2, step_timeout_s=10.0) as e:
            await generate(e, request("Warm", max_tokens=2))
            await idle(e)  # no step out: the next one is the image's
            result = e.workers.result
            failed: list[int] = []

            async def failing_result(sent, timeout):  # delegates, except for one step
                if not failed:
                    failed.append(sent.step_id)
                    # worker 1 runs the step (acknowledging slot 1); worker 0 is stopped
                    await until(lambda: e.cache_stats().shm_unacked_refs == 1)
                    raise RuntimeError("injected: applying the step failed")
                return await result(sent, timeout)

            e.workers.result = failing_result  # type: ignore[method-assign]
            os.kill(pids[0], signal.SIGSTOP)
            try:
                with pytest.raises(TandemError) as err:
                    await generate(e, request(PROMPT, [png(6, 56, 56)], max_tokens=4))
                assert err.value.code == grpc.StatusCode.INTERNAL
                assert e.errors == 1 and e.cache_stats().shm_unacked_refs == 1
            finally:
                os.kill(pids[0], signal.SIGCONT)
            await until(lambda: e.cache_stats().shm_unacked_refs == 0
                        and e.ledger_stats().in_doubt == 0, timeout=15.0,
                        state=lambda: (e.cache_stats(), e.ledger_stats(), e.errors,
                                       e.serving))
            assert e.serving
            assert await generate(e, request("After the error", max_tokens=2)) != []

    asyncio.run(main())
