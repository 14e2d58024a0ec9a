"""A relay between a scheduler and a real worker: forwards every Worker and health call
unchanged, records the steps, and refuses the ones a test chooses, answering as a healthy
worker refusing a step does (INVALID_ARGUMENT with a google.rpc.ErrorInfo), or answers them
twice (a stray reply on the step stream), or holds the stream's steps until the test opens
``gate`` (a slow network). A network-fault injector, not a stand-in: the worker behind it
is the real process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2_grpc

from tandem.errors import InvalidInput, rich_status
from tandem.v1 import worker_pb2, worker_pb2_grpc

REFUSAL = InvalidInput("step refused by the test relay", "BAD_TOKENS")


class Relay(worker_pb2_grpc.WorkerServicer, health_pb2_grpc.HealthServicer):
    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.worker = worker_pb2_grpc.WorkerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.refuse: Callable[[worker_pb2.StepRequest], bool] = lambda _: False
        self.repeat: Callable[[worker_pb2.StepRequest], bool] = lambda _: False
        self.steps: list[worker_pb2.StepRequest] = []  # every step forwarded
        self.refused = 0
        self.gate = asyncio.Event()  # stream steps wait for it; open unless a test closes it
        self.gate.set()

    async def Describe(self, msg, context):
        return await self.worker.Describe(msg, timeout=context.time_remaining())

    async def Step(self, msg, context):
        if self._refused(msg):
            context.set_trailing_metadata(rich_status(REFUSAL))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, REFUSAL.message)
        return await self.worker.Step(msg, timeout=context.time_remaining())

    async def Steps(self, requests, context):
        """As a worker's stream: a refused step is answered with its error and every later
        one as not run. The others go to the worker over a Steps stream of the relay's,
        one at a time (the relay does not pipeline)."""
        upstream = self.worker.Steps()
        refused = False
        try:
            async for msg in requests:
                step_id = msg.step.step_id
                if refused:
                    yield worker_pb2.StepsResponse(step_id=step_id, not_run=True)
                elif self._refused(msg.step):
                    refused = True
                    yield worker_pb2.StepsResponse(step_id=step_id, error=worker_pb2.StepError(
                        code=REFUSAL.code.value[0], message=REFUSAL.message,
                        reason=REFUSAL.reason))
                else:
                    await self.gate.wait()
                    await upstream.write(msg)
                    reply = await upstream.read()
                    yield reply
                    if self.repeat(msg.step):
                        yield reply
        finally:
            upstream.cancel()

    def _refused(self, msg: worker_pb2.StepRequest) -> bool:
        if self.refuse(msg):
            self.refused += 1
            return True
        self.steps.append(msg)
        return False

    async def Watch(self, msg, context):
        async for reply in self.health.Watch(msg):
            yield reply


@asynccontextmanager
async def relay(worker_socket: Path, path: Path) -> AsyncIterator[Relay]:
    """A relay on the Unix socket ``path`` in front of the worker at ``worker_socket``."""
    servicer = Relay(f"unix://{worker_socket}")
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    try:
        yield servicer
    finally:
        await server.stop(0)
        await servicer.channel.close()
