"""tandem.v1.Generation over the engine: a thin adapter, errors mapped by the interceptor."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

import grpc

from scheduler_svc.engine import Engine
from scheduler_svc.image_usage import usage_images
from scheduler_svc.request import Request, StepOutput
from scheduler_svc.request_telemetry import RequestTelemetry
from tandem.metrics import RequestLatency
from tandem.text import Tokenizer
from tandem.v1 import generate_pb2, generate_pb2_grpc, worker_pb2


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """Generate (server stream, one message per step), CacheStats and GetModelInfo."""

    def __init__(self, engine: Engine, latency: RequestLatency | None = None) -> None:
        self.engine = engine
        self.latency = latency  # histograms, when metrics are on

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        first = True
        async with aclosing(responses(self.engine, request, self.latency)) as stream:
            async for msg in stream:
                if first:
                    await context.send_initial_metadata((("x-request-id", msg.request_id),))
                    first = False
                yield msg

    async def CacheStats(self, request: generate_pb2.CacheStatsRequest,
                         context: grpc.aio.ServicerContext) -> generate_pb2.CacheStatsResponse:
        return self.engine.cache_stats()

    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext,
                           ) -> generate_pb2.GetModelInfoResponse:
        return self.engine.model_info()


async def responses(engine: Engine, request: generate_pb2.GenerateRequest,
                    latency: RequestLatency | None,
                    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
    """One request's stream, the one place both APIs run it (gRPC here, HTTP through
    ``http_backend``): inside its RequestTelemetry (the ``generate_content`` span and the
    latency histograms), one ``to_response`` message per step."""
    model = engine.model.name if engine.model is not None else "unknown"
    with RequestTelemetry(model, request, latency) as telemetry:
        # aclosing: when this stream is closed (the client left), the engine's stream closes
        # (and aborts the request) now, not whenever the garbage collector finalizes it.
        async with aclosing(engine.generate(request, telemetry.trace)) as outputs:
            async for req, out in outputs:
                telemetry.output(req, out.token_ids)
                yield to_response(req, out, engine.tokenizer)


def to_response(req: Request, out: StepOutput,
                tokenizer: Tokenizer) -> generate_pb2.GenerateResponse:
    """One stream message; the last carries the finish reason and usage."""
    msg = generate_pb2.GenerateResponse(
        request_id=req.request_id, token_ids=out.token_ids, text=out.text,
        finish_reason=out.finish_reason,
        logprobs=logprobs_to_proto(out.token_ids, out.logprobs, tokenizer))
    if out.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
        msg.usage.CopyFrom(generate_pb2.Usage(
            prompt_tokens=req.num_prompt_tokens, completion_tokens=req.num_output_tokens,
            cached_prompt_tokens=max(req.num_cached_tokens, 0), mm_items=len(req.features),
            mm_cache_hits=req.mm_cache_hits, encoder_runs=req.encoder_runs,
            images=usage_images(req.images, req.num_cached_tokens)))
        if req.constraint is not None:
            msg.usage.constraint.CopyFrom(generate_pb2.ConstraintUsage(
                kind=req.constraint.kind, compile_ms=req.constraint.compile_ms,
                cache_hit=req.constraint.cache_hit))
    return msg


def logprobs_to_proto(token_ids: Sequence[int], logprobs: Sequence[worker_pb2.SampledLogprobs],
                      tokenizer: Tokenizer) -> list[generate_pb2.PositionLogprobs]:
    """The workers' logprobs of ``token_ids`` (one each, or none) with each token's text
    and bytes."""
    if not logprobs:
        return []

    def token(token_id: int, logprob: float) -> generate_pb2.TokenLogprob:
        return generate_pb2.TokenLogprob(
            token_id=token_id, logprob=logprob,
            text=tokenizer.decode([token_id], skip_special_tokens=False),
            token_bytes=tokenizer.token_bytes(token_id), special=tokenizer.is_special(token_id))

    return [generate_pb2.PositionLogprobs(
        token=token(t, lp.logprob),
        top_logprobs=[token(i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs,
                                                  strict=True)])
        for t, lp in zip(token_ids, logprobs, strict=True)]
