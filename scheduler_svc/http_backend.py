"""The HTTP API's backend in the scheduler: the engine itself, no gRPC hop inside the cell.

Each request runs exactly as the gRPC servicer runs it: the same RequestTelemetry (the
``generate_content`` span and the latency histograms) and the same ``to_response``, so the
HTTP app converts the very messages a gRPC client would receive.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from scheduler_svc.engine import Engine
from scheduler_svc.request_telemetry import RequestTelemetry
from scheduler_svc.servicer import to_response
from tandem.metrics import RequestLatency
from tandem.v1 import generate_pb2


class EngineBackend:
    """:class:`tandem.openai_api.backend.Backend` over the cell's engine."""

    def __init__(self, engine: Engine, latency: RequestLatency | None) -> None:
        self.engine = engine
        self.latency = latency

    async def generate(self, request: generate_pb2.GenerateRequest,
                       ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        model = self.engine.model.name if self.engine.model is not None else "unknown"
        with RequestTelemetry(model, request, self.latency) as telemetry:
            # aclosing: when the client leaves, the engine's stream closes (and aborts
            # the request) now, not whenever the garbage collector finalizes it.
            async with aclosing(self.engine.generate(request, telemetry.trace)) as outputs:
                async for req, out in outputs:
                    telemetry.output(req, out.token_ids)
                    yield to_response(req, out, self.engine.tokenizer)

    async def model_info(self) -> generate_pb2.GetModelInfoResponse:
        return self.engine.model_info()
