"""The scheduler's side of the worker connections: one channel and one step stream per rank."""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.errors import Unavailable, error_info
from tandem.feature_codec import descriptor_to_proto
from tandem.shm import ShmDescriptor
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 1 << 30),
    ("grpc.max_receive_message_length", 64 << 20),
]


@dataclass(frozen=True, slots=True)
class StepResult:
    sampled: dict[str, list[int]]  # rank 0's samples
    # rank 0's logprobs, one per sampled token, for the requests that asked
    logprobs: dict[str, list[worker_pb2.SampledLogprobs]]
    shm_resolved: int  # summed over workers
    shm_acked: int
    encoder_runs: int  # rank 0's


# A worker's Unix socket file as (device, inode). NOTE: an inode number reused by a new
# socket hides a replacement (then nothing is reset: the safe side); nothing but a new
# process ever gives the same path another inode.
SocketIdentity = tuple[int, int]


@dataclass(frozen=True, slots=True)
class SentStep:
    """A step written to every worker's stream: one answer future per rank."""

    step_id: int
    futures: list[asyncio.Future[worker_pb2.StepResponse]]


class _StepStream:
    """One worker's ``Steps`` call: steps are written in order and answered in order, so
    the n-th answer belongs to the n-th step still pending.

    A step the worker failed is answered with its error (:class:`WorkerStepError`) and the
    ones behind it with not run (:class:`NotRun`, worker.proto); the stream is then spent:
    closed for writing, and steps sent on it fail as not run until the pool retires it
    (:meth:`WorkerPool.end_streams`) and opens a new one for the next step. When the call
    itself ends (the connection broke, the worker died, it was cancelled), the first
    pending step fails with the call's status and the ones behind it as not run, although
    then nobody knows whether they ran: the engine treats any such failure as a loss.
    Whatever ends the reader (a stray reply, an unexpected error) ends the stream the same
    way: its steps fail, none is left waiting for an answer that will never be read.
    """

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, rank: int) -> None:
        self.rank = rank
        self.call = stub.Steps()
        self.pending: deque[tuple[int, asyncio.Future[worker_pb2.StepResponse]]] = deque()
        self.ended = False  # no step may be sent on it any more
        # The engine has dealt with how it ended: the next step may go on a new stream.
        self.retired = False
        self.reader = asyncio.get_running_loop().create_task(self._read(),
                                                             name=f"steps-{rank}")

    async def send(self, msg: worker_pb2.StepRequest) -> asyncio.Future[worker_pb2.StepResponse]:
        future: asyncio.Future[worker_pb2.StepResponse] = (
            asyncio.get_running_loop().create_future())
        future.add_done_callback(_retrieve)  # the engine may abandon steps after a loss
        if self.ended:  # the reader has failed everything pending already
            future.set_exception(NotRun("the step stream ended before this step was sent"))
            return future
        self.pending.append((msg.step_id, future))
        try:
            await self.call.write(worker_pb2.StepsRequest(step=msg))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            self.cancel()  # the reader sees the end and fails this step with the others
        return future

    async def send_masks(self, msg: worker_pb2.StepMasks) -> None:
        """The deferred masks of a step sent earlier on this stream; on an ended stream
        that step fails as not run, so it needs none."""
        if self.ended:
            return
        try:
            await self.call.write(worker_pb2.StepsRequest(masks=msg))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            self.cancel()  # the reader sees the end and fails the pending steps

    def cancel(self) -> None:
        self.ended = True
        self.call.cancel()

    async def _read(self) -> None:
        error: BaseException
        try:
            async for reply in self.call:
                if not self.pending:
                    raise RuntimeError(f"worker {self.rank} answered step {reply.step_id}, "
                                       "which is not pending")
                step_id, future = self.pending.popleft()
                if reply.step_id != step_id:
                    raise RuntimeError(f"worker {self.rank} answered step {reply.step_id} "
                                       f"where {step_id} was next")
                outcome = reply.WhichOneof("outcome")
                if outcome == "done":
                    _settle(future, reply.done)
                    continue
                _settle(future, WorkerStepError(reply.error) if outcome == "error"
                        else NotRun(f"not run: worker {self.rank} failed an earlier step"))
                if not self.ended:
                    self.ended = True
                    await self.call.done_writing()  # the worker answers the rest, then ends
            error = RuntimeError(f"worker {self.rank} ended its step stream")
        except asyncio.CancelledError:
            error = RuntimeError("the step stream was cancelled")
        except grpc.aio.AioRpcError as exc:  # the call ended: the pool logs the failure
            error = exc
        except Exception as exc:  # a stray reply, or a bug: the steps fail, never hang
            log.error("the step stream of worker %d failed", self.rank, exc_info=exc)
            error = exc
        self.ended = True
        self.call.cancel()
        first = True
        while self.pending:
            _, future = self.pending.popleft()
            _settle(future, error if first else NotRun(
                f"not run: worker {self.rank} ended the stream at an earlier step"))
            first = False


def _settle(future: asyncio.Future[worker_pb2.StepResponse],
            outcome: worker_pb2.StepResponse | BaseException) -> None:
    """Resolve a step's future, unless whoever waited for it cancelled it already."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _retrieve(future: asyncio.Future[worker_pb2.StepResponse]) -> None:
    if not future.cancelled():
        future.exception()


class NotRun(Exception):
    """A step queued behind one that failed on a worker's stream: the worker never ran it."""


class WorkerStepError(Exception):
    """A worker answered a step with an error (the status its Step would have ended with)."""

    def __init__(self, error: worker_pb2.StepError) -> None:
        super().__init__(error.message)
        self.code = _STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN)
        self.message = error.message
        self.reason = error.reason


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class WorkerPool:
    """Sends each step to every worker at once, over one persistent ``Steps`` stream per
    worker; any failure fails the step (StepFailed)."""

    def __init__(self, addresses: list[str]) -> None:
        if not addresses:
            raise ValueError("at least one worker address is needed")
        self.addresses = addresses
        self._channels = [grpc.aio.insecure_channel(a, options=_CHANNEL_OPTIONS)
                          for a in addresses]
        self._stubs = [worker_pb2_grpc.WorkerStub(c) for c in self._channels]
        self.sockets: list[SocketIdentity | None] = [None] * len(addresses)
        self._streams: list[_StepStream | None] = [None] * len(addresses)

    async def describe(self, timeout: float) -> list[worker_pb2.DescribeResponse]:
        """Every worker's description, once all answer; ``sockets`` then says which socket
        file each answered on."""
        try:
            out = list(await asyncio.gather(*(
                s.Describe(worker_pb2.DescribeRequest(), timeout=timeout, wait_for_ready=True)
                for s in self._stubs)))
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"worker not reachable: {exc.code().name}") from exc
        self.sockets = [_socket_identity(a) for a in self.addresses]
        return out

    def replaced(self, before: list[SocketIdentity | None]) -> list[int]:
        """Ranks whose worker process is known to have been replaced since ``before``.

        Why the socket file: a worker binds a fresh one when it starts (removing its
        predecessor's), and its supervisor (``tandem serve``, or the kubelet) starts it
        only after the predecessor exited. TCP workers are never known replaced.
        """
        return [rank for rank, (old, new) in enumerate(zip(before, self.sockets, strict=True))
                if old is not None and new is not None and old != new]

    async def send(self, msg: worker_pb2.StepRequest) -> SentStep:
        """Write ``msg`` to every worker's step stream without waiting for the step to run;
        :meth:`result` waits for it.

        A stream is opened on first use and again after :meth:`end_streams`, never merely
        because the last one ended: a step sent after an earlier one failed was built on
        that step's effects and must not run (it fails as not run), until the engine has
        dealt with the failure."""
        for rank, stream in enumerate(self._streams):
            if stream is None or stream.retired:
                self._streams[rank] = _StepStream(self._stubs[rank], rank)
        futures = [await stream.send(msg) for stream in self._streams if stream is not None]
        return SentStep(msg.step_id, futures)

    async def send_masks(self, step_id: int, masks: dict[str, bytes]) -> None:
        """The deferred token masks of step ``step_id`` (sent, its result not applied yet)
        to every worker: each waits for them before sampling it (worker.proto)."""
        msg = worker_pb2.StepMasks(step_id=step_id, token_masks=masks)
        for stream in self._streams:
            if stream is not None:
                await stream.send_masks(msg)

    async def result(self, sent: SentStep, timeout: float) -> StepResult:
        """The outcome of a sent step on every worker, waiting at most ``timeout`` seconds
        from now; any failure fails the step (StepFailed). A worker that does not answer
        in time has its stream cancelled, so the steps sent after this one fail too."""
        _, late = await asyncio.wait(sent.futures, timeout=timeout)
        for rank, future in enumerate(sent.futures):
            if future in late:
                stream = self._streams[rank]
                if stream is not None:
                    stream.cancel()
        results = await asyncio.gather(*sent.futures, return_exceptions=True)
        failures = tuple(
            RankFailure(rank, grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"no answer within {timeout:g} s", False) if future in late
            else _failure(rank, r)
            for rank, (future, r) in enumerate(zip(sent.futures, results, strict=True))
            if isinstance(r, BaseException))
        if failures:
            for f in failures:
                if not f.not_run:
                    log.error("step %d failed on worker %d: %s %s%s", sent.step_id, f.rank,
                              f.code.name if f.code else "error", f.details,
                              " (refused)" if f.refused else "")
            raise StepFailed(failures)
        ok: list[worker_pb2.StepResponse] = results  # type: ignore[assignment]
        return StepResult(
            sampled={k: list(v.token_ids) for k, v in ok[0].sampled.items()},
            logprobs={k: list(v.logprobs) for k, v in ok[0].sampled.items() if v.logprobs},
            shm_resolved=sum(r.shm_resolved for r in ok),
            shm_acked=sum(r.shm_acked for r in ok),
            encoder_runs=ok[0].encoder_runs,
        )

    async def acknowledge(self, rank: int, segment: str, generation: int,
                          steps: list[tuple[int, list[ShmDescriptor]]],
                          timeout: float) -> worker_pb2.AcknowledgeResponse:
        """Ask worker ``rank`` to acknowledge, on its reader slot, the address items of
        ``steps`` (id, descriptors) it never received (worker.proto, Acknowledge); with no
        steps, wait until every step it received is done. Call with its stream ended."""
        msg = worker_pb2.AcknowledgeRequest(segment_name=segment, segment_generation=generation)
        for step_id, refs in steps:
            msg.steps.add(step_id=step_id, items=[descriptor_to_proto(d) for d in refs])
        try:
            return await self._stubs[rank].Acknowledge(msg, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"worker {rank} did not acknowledge: {exc.code().name} "
                              f"{exc.details()}") from exc

    def end_streams(self) -> None:
        """Cancel every step stream; the next step opens fresh ones. The engine calls it
        once it has dealt with a failed step (the steps still out are undone or in doubt)."""
        for stream in self._streams:
            if stream is not None:
                stream.cancel()
                stream.retired = True

    async def wait_lost(self) -> int:
        """Wait until a worker's health stream ends or stops saying SERVING; its rank.

        Why: a worker that dies while the cell is idle fails no step, and its replacement
        starts with an empty KV cache, so the scheduler must notice on its own or it would
        point prefix-cache hits at blocks the new worker never computed.
        """
        watches = [asyncio.create_task(self._watch(rank, channel))
                   for rank, channel in enumerate(self._channels)]
        try:
            done, _ = await asyncio.wait(watches, return_when=asyncio.FIRST_COMPLETED)
            return done.pop().result()
        finally:
            for w in watches:
                w.cancel()
            await asyncio.gather(*watches, return_exceptions=True)

    @staticmethod
    async def _watch(rank: int, channel: grpc.aio.Channel) -> int:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            async for reply in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    break
        except grpc.aio.AioRpcError as exc:
            log.warning("health stream of worker %d ended: %s", rank, exc.code().name)
        return rank

    async def close(self) -> None:
        self.end_streams()
        await asyncio.gather(*(s.reader for s in self._streams if s is not None),
                             return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self._channels))


@dataclass(frozen=True, slots=True)
class RankFailure:
    rank: int
    code: grpc.StatusCode | None  # None: not an RPC error
    details: str
    refused: bool  # the worker answered that it refused the step (see StepFailed)
    not_run: bool = False  # queued behind a failed step: the worker never ran it


class StepFailed(Exception):
    """Some workers did not complete a step (``failures``, one per rank, in rank order).

    ``refused``: every failing worker answered, with a status of its own (an ErrorInfo),
    that it refused the step as invalid (INVALID_ARGUMENT or FAILED_PRECONDITION). A worker
    checks a whole step before changing anything, so it is alive, acknowledged nothing of
    it and holds the same state as before: the step's requests fail, not the cell. Any
    other failure (timeout, cancellation, a broken connection, an internal error) leaves
    the worker's state unknown.
    """

    def __init__(self, failures: tuple[RankFailure, ...]) -> None:
        first = failures[0]
        super().__init__(f"worker {first.rank}: "
                         f"{first.code.name if first.code else 'error'}: {first.details}")
        self.failures = failures

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(f.rank for f in self.failures)

    @property
    def refused(self) -> bool:
        return all(f.refused for f in self.failures)

    @property
    def not_run(self) -> bool:
        """Every failing worker never ran the step (an earlier step failed on it)."""
        return all(f.not_run for f in self.failures)


_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


def _failure(rank: int, exc: BaseException) -> RankFailure:
    if isinstance(exc, NotRun):
        return RankFailure(rank, None, str(exc), False, not_run=True)
    if isinstance(exc, WorkerStepError):
        return RankFailure(rank, exc.code, exc.message,
                           exc.code in _REFUSALS and bool(exc.reason))
    if not isinstance(exc, grpc.aio.AioRpcError):
        return RankFailure(rank, None, repr(exc), False)
    refused = exc.code() in _REFUSALS and error_info(exc) is not None
    return RankFailure(rank, exc.code(), exc.details() or "", refused)


def _socket_identity(address: str) -> SocketIdentity | None:
    if not address.startswith("unix:"):
        return None
    path = address.removeprefix("unix://") if address.startswith("unix://") else address[5:]
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
