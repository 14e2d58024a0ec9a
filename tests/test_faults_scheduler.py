"""The scheduler killed with SIGKILL, with its workers running on (``tandem worker`` and
``tandem scheduler`` as separate processes, as in a Kubernetes cell).

What must hold: the in-flight client gets a status, a new scheduler creates a new segment
generation, the workers re-attach to it and drop the dead scheduler's requests, a descriptor
of the old generation is refused even where it names the same address and id as a live
object of the new one, and serving resumes with the same greedy outputs.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem.errors import error_info
from tandem.shm.segment import C_ID, C_NBYTES, C_TAG, HEADER_SIZE, LIVE_TAG
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem_testing.cells import Cell, _wait_serving, free_port, png, request

WORKERS = 2
PROMPT = "Describe <image> in a few words."
ENV = dict(os.environ, PYTHONUNBUFFERED="1", TANDEM_DEBUG_INVARIANTS="1")


@contextlib.contextmanager
def _process(cmd: list[str], log: Path) -> Iterator[subprocess.Popen]:
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tandem_cli.cli", *cmd], stdout=out,
                                stderr=subprocess.STDOUT, env=ENV)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@contextlib.contextmanager
def _scheduler(tmp: Path, shm: Path, name: str) -> Iterator[Cell]:
    port = free_port()
    cmd = ["scheduler", "--shm-dir", str(shm), "--workers", str(WORKERS),
           "--listen", f"127.0.0.1:{port}"]
    with _process(cmd, tmp / f"{name}.log") as proc, \
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        cell = Cell(f"127.0.0.1:{port}", shm, proc, channel)
        _wait_serving(cell, 90, tmp / f"{name}.log")
        yield cell


def _worker_stub(shm: Path, rank: int, stack: contextlib.ExitStack) -> worker_pb2_grpc.WorkerStub:
    channel = stack.enter_context(grpc.insecure_channel(f"unix://{shm}/worker-{rank}.sock"))
    return worker_pb2_grpc.WorkerStub(channel)


def _generation(stub: worker_pb2_grpc.WorkerStub) -> int:
    return stub.Describe(worker_pb2.DescribeRequest(), timeout=30).segment_generation


def _stream_until_killed(cell: Cell, started: threading.Event, out: list[str]) -> None:
    msg = request("Doomed <image> keeps going", [png(2)], max_tokens=1000, ignore_eos=True)
    msg.request_id = "client-7"
    try:
        for _ in cell.stub.Generate(msg, timeout=60):
            started.set()
        out.append("OK")
    except grpc.RpcError as exc:
        out.append(exc.code().name)
    started.set()


def test_scheduler_killed_workers_reattach(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    with contextlib.ExitStack() as stack:
        for rank in range(WORKERS):
            stack.enter_context(_process(
                ["worker", "--shm-dir", str(shm), "--rank", str(rank), "--workers",
                 str(WORKERS), "--kv-cache-size", "16Mi"], tmp_path / f"worker-{rank}.log"))
        stubs = [_worker_stub(shm, r, stack) for r in range(WORKERS)]
        with _scheduler(tmp_path, shm, "first") as first:
            reference = first.generate(PROMPT, [png(1)], max_tokens=8)[0]
            old_generation = _generation(stubs[0])
            started, outcome = threading.Event(), []
            client = threading.Thread(target=_stream_until_killed,
                                      args=(first, started, outcome))
            client.start()
            assert started.wait(60)
            first.proc.kill()
            first.proc.wait()
            client.join(30)
        assert outcome == ["UNAVAILABLE"]
        assert old_generation != 0 and all(_generation(s) == old_generation for s in stubs)

        with _scheduler(tmp_path, shm, "second") as second:
            # The client retries with the same request id: the workers dropped the dead
            # scheduler's request of that id when the new generation reached them.
            msg = request(PROMPT, [png(1)], max_tokens=8)
            msg.request_id = "client-7"
            ids = [t for out in second.stub.Generate(msg, timeout=60) for t in out.token_ids]
            assert ids == reference
            new_generation = _generation(stubs[0])
            assert new_generation not in (0, old_generation)
            assert all(_generation(s) == new_generation for s in stubs)
            for stub in stubs:
                _refuse_old_descriptor(stub, shm, old_generation, new_generation)
            assert second.generate(PROMPT, [png(1)], max_tokens=8)[0] == reference
            stats = second.stats()
            assert stats.shm_unacked_refs == 0 and stats.kv_blocks_free == stats.kv_blocks_total


def _live_chunk_at_zero(shm: Path) -> tuple[int, int]:
    """(monotonic id, nbytes) of the live object at data-area address 0, read from the file."""
    words = memoryview((shm / "features.seg").read_bytes()[HEADER_SIZE:HEADER_SIZE + 64]).cast("Q")
    assert words[C_TAG] == LIVE_TAG
    return words[C_ID], words[C_NBYTES]


def _refuse_old_descriptor(stub: worker_pb2_grpc.WorkerStub, shm: Path, old: int,
                           new: int) -> None:
    """A descriptor of the old generation naming exactly the address, id and size of a live
    object of the new segment: the worker must refuse it, whichever generation the step
    names, and acknowledge nothing."""
    monotonic_id, nbytes = _live_chunk_at_zero(shm)
    for step_generation in (new, old):
        step = worker_pb2.StepRequest(step_id=1, segment_name="features.seg",
                                      segment_generation=step_generation)
        step.new_requests.add(request_id="stale", token_ids=[1, 259], num_prompt_tokens=2,
                              block_ids=[0]).features.add(
            identifier="x", modality="image", offset=1, length=1,
            shm=worker_pb2.ShmAddress(generation=old, address=0, monotonic_id=monotonic_id,
                                      refs=1, nbytes=nbytes))
        step.num_scheduled_tokens["stale"] = 2
        step.scheduled_encoder_inputs["stale"].feature_indices.append(0)
        with pytest.raises(grpc.RpcError) as err:
            stub.Step(step, timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(err.value).reason == "SHM_GENERATION_MISMATCH"
