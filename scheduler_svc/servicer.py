"""tandem.v1.Generation over the engine: a thin adapter, errors mapped by the interceptor."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from scheduler_svc.engine import Engine
from scheduler_svc.image_usage import usage_images
from scheduler_svc.request import Request, StepOutput
from scheduler_svc.request_telemetry import RequestTelemetry
from tandem.metrics import RequestLatency
from tandem.text import IncrementalDecoder
from tandem.v1 import generate_pb2, generate_pb2_grpc


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """Generate (server stream, one message per step) and CacheStats."""

    def __init__(self, engine: Engine, latency: RequestLatency | None = None) -> None:
        self.engine = engine
        self.latency = latency  # histograms, when metrics are on

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        decoder = self.engine.tokenizer.incremental_decoder()
        first = True
        model = self.engine.model.name if self.engine.model is not None else "unknown"
        with RequestTelemetry(model, request, self.latency) as telemetry:
            async for req, out in self.engine.generate(request, telemetry.trace):
                if first:
                    await context.send_initial_metadata((("x-request-id", req.request_id),))
                    first = False
                telemetry.output(req, out.token_ids)
                yield to_response(req, out, decoder)

    async def CacheStats(self, request: generate_pb2.CacheStatsRequest,
                         context: grpc.aio.ServicerContext) -> generate_pb2.CacheStatsResponse:
        return self.engine.cache_stats()


def to_response(req: Request, out: StepOutput,
                decoder: IncrementalDecoder) -> generate_pb2.GenerateResponse:
    """One stream message; the last carries the finish reason and usage."""
    text = decoder.feed(out.token_ids)
    msg = generate_pb2.GenerateResponse(request_id=req.request_id, token_ids=out.token_ids,
                                        finish_reason=out.finish_reason)
    if out.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
        msg.text = text + decoder.flush()
        msg.usage.CopyFrom(generate_pb2.Usage(
            prompt_tokens=req.num_prompt_tokens, completion_tokens=req.num_output_tokens,
            cached_prompt_tokens=max(req.num_cached_tokens, 0), mm_items=len(req.features),
            mm_cache_hits=req.mm_cache_hits, encoder_runs=req.encoder_runs,
            images=usage_images(req.images, req.num_cached_tokens)))
    else:
        msg.text = text
    return msg
