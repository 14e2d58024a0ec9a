"""The HTTP API's backend in the router: each request forwarded to a cell over gRPC.

The same routing as the router's gRPC Generate (:mod:`router_svc.forwarding`): cache
affinity, the load bound, failover before the first message. A cell's failure arrives
as its status and ErrorInfo reason, and leaves as the same HTTP error the cell's own
HTTP port would have given.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
from opentelemetry import context as otel_context

from router_svc.forwarding import Forwarder
from tandem.errors import from_rpc_error
from tandem.v1 import generate_pb2

# Every request checks its model name against the model info: asking a cell each time
# would add a round trip per request, so an answer is reused this long (a rolled-out new
# model shows within it).
MODEL_INFO_TTL_S = 10.0


class RouterBackend:
    """:class:`tandem.openai_api.backend.Backend` over the router's cells."""

    def __init__(self, forwarder: Forwarder) -> None:
        self.forwarder = forwarder
        self._info: tuple[float, generate_pb2.GetModelInfoResponse] | None = None

    async def generate(self, request: generate_pb2.GenerateRequest,
                       ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        stream = self.forwarder.generate(request, otel_context.get_current())
        try:
            async with aclosing(stream):
                async for msg in stream:
                    yield msg
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def model_info(self) -> generate_pb2.GetModelInfoResponse:
        now = time.monotonic()
        if self._info is None or now - self._info[0] > MODEL_INFO_TTL_S:
            info, _ = await self.forwarder.model_info()
            self._info = (now, info)
        return self._info[1]
