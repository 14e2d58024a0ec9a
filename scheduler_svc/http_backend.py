"""The HTTP API's backend in the scheduler: the engine itself, no gRPC hop inside the cell.

Each request runs through the gRPC servicer's own ``responses`` (the same RequestTelemetry
and ``to_response``), so the HTTP app converts the very messages a gRPC client would receive.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from scheduler_svc.engine import Engine
from scheduler_svc.servicer import responses
from tandem.metrics import RequestLatency
from tandem.v1 import generate_pb2


class EngineBackend:
    """:class:`tandem.openai_api.backend.Backend` over the cell's engine."""

    def __init__(self, engine: Engine, latency: RequestLatency | None) -> None:
        self.engine = engine
        self.latency = latency

    def generate(self, request: generate_pb2.GenerateRequest,
                 ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        return responses(self.engine, request, self.latency)

    async def model_info(self) -> generate_pb2.GetModelInfoResponse:
        return self.engine.model_info()
