"""The scheduler's side of the worker connections: one channel per rank."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

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
            raise StepFailed(rank, code, details or "", tuple(r for r, _ in failed))
        ok: list[worker_pb2.StepResponse] = results  # type: ignore[assignment]
        return StepResult(
            sampled={k: list(v.token_ids) for k, v in ok[0].sampled.items()},
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


class StepFailed(Exception):
    """A worker did not complete a step: ``code`` is its gRPC status (None if no status).

    ``ranks`` are all the workers that failed it (``rank`` is the first): none of them
    acknowledged the step's address items.
    """

    def __init__(self, rank: int, code: grpc.StatusCode | None, details: str,
                 ranks: tuple[int, ...] = ()) -> None:
        super().__init__(f"worker {rank}: {code.name if code else 'error'}: {details}")
        self.rank = rank
        self.code = code
        self.details = details
        self.ranks = ranks or (rank,)

    @property
    def worker_lost(self) -> bool:
        return self.code in (None, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
