"""The scheduler's side of the worker connections: one channel per rank."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.errors import Unavailable, error_info
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


class WorkerPool:
    """Sends each step to every worker at once; any failure fails the step (StepFailed)."""

    def __init__(self, addresses: list[str]) -> None:
        if not addresses:
            raise ValueError("at least one worker address is needed")
        self.addresses = addresses
        self._channels = [grpc.aio.insecure_channel(a, options=_CHANNEL_OPTIONS)
                          for a in addresses]
        self._stubs = [worker_pb2_grpc.WorkerStub(c) for c in self._channels]
        self.sockets: list[SocketIdentity | None] = [None] * len(addresses)

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

    async def step(self, msg: worker_pb2.StepRequest, timeout: float) -> StepResult:
        calls = [s.Step(msg, timeout=timeout) for s in self._stubs]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failures = tuple(_failure(rank, r) for rank, r in enumerate(results)
                         if isinstance(r, BaseException))
        if failures:
            for f in failures:
                log.error("step %d failed on worker %d: %s %s%s", msg.step_id, f.rank,
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
        await asyncio.gather(*(c.close() for c in self._channels))


@dataclass(frozen=True, slots=True)
class RankFailure:
    rank: int
    code: grpc.StatusCode | None  # None: not an RPC error
    details: str
    refused: bool  # the worker answered that it refused the step (see StepFailed)


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


_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


def _failure(rank: int, exc: BaseException) -> RankFailure:
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
