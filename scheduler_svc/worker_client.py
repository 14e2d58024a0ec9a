"""The scheduler's side of the worker connections: one channel per rank."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from tandem.errors import Unavailable
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 1 << 30),
    ("grpc.max_receive_message_length", 64 << 20),
]


@dataclass(frozen=True, slots=True)
class StepResult:
    sampled: dict[str, list[int]]  # rank 0's samples
    shm_resolved: int  # summed over workers
    shm_acked: int
    encoder_runs: int  # rank 0's


class WorkerPool:
    """Sends each step to every worker at once; any failure fails the step as UNAVAILABLE."""

    def __init__(self, addresses: list[str]) -> None:
        assert addresses, "at least one worker address is needed"
        self.addresses = addresses
        self._channels = [grpc.aio.insecure_channel(a, options=_CHANNEL_OPTIONS)
                          for a in addresses]
        self._stubs = [worker_pb2_grpc.WorkerStub(c) for c in self._channels]

    async def describe(self, timeout: float) -> list[worker_pb2.DescribeResponse]:
        try:
            return list(await asyncio.gather(*(
                s.Describe(worker_pb2.DescribeRequest(), timeout=timeout, wait_for_ready=True)
                for s in self._stubs)))
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"worker not reachable: {exc.code().name}") from exc

    async def step(self, msg: worker_pb2.StepRequest, timeout: float) -> StepResult:
        calls = [s.Step(msg, timeout=timeout) for s in self._stubs]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [(rank, r) for rank, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            rank, exc = failed[0]
            code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
            details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
            log.error("step %d failed on worker %d: %s %s", msg.step_id, rank, code, details)
            raise StepFailed(rank, code, details or "")
        ok: list[worker_pb2.StepResponse] = results  # type: ignore[assignment]
        return StepResult(
            sampled={k: list(v.token_ids) for k, v in ok[0].sampled.items()},
            shm_resolved=sum(r.shm_resolved for r in ok),
            shm_acked=sum(r.shm_acked for r in ok),
            encoder_runs=ok[0].encoder_runs,
        )

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels))


class StepFailed(Exception):
    """A worker did not complete a step: ``code`` is its gRPC status (None if no status)."""

    def __init__(self, rank: int, code: grpc.StatusCode | None, details: str) -> None:
        super().__init__(f"worker {rank}: {code.name if code else 'error'}: {details}")
        self.rank = rank
        self.code = code
        self.details = details

    @property
    def worker_lost(self) -> bool:
        return self.code in (None, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
