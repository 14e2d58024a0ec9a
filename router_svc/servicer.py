"""tandem.v1.Generation in front of many cells: route, stream through, aggregate stats.

Generate picks a cell with the balancer and relays the cell's stream unchanged: its
messages, its initial metadata (``x-request-id``) plus ``x-tandem-cell`` naming the cell,
and on failure its status code, details and trailing metadata (the ``ErrorInfo``). The
client's remaining deadline becomes the upstream call's timeout, and when the client
cancels (or its deadline passes) the upstream call is cancelled with it, so the cell frees
the request's KV blocks at once.

A cell that fails with UNAVAILABLE before sending anything never started the answer, so
the request is retried on the next cell of its ring order (a ``failover``); after the
first message has gone out a retry would duplicate output, so the error passes through.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from router_svc.balancer import Balancer, RouteDecision
from router_svc.cell_pool import CellPool
from router_svc.routing_key import routing_key
from tandem.cell_stats import aggregate, per_cell_metadata
from tandem.v1 import generate_pb2, generate_pb2_grpc

CELL_HEADER = "x-tandem-cell"
STATS_TIMEOUT_S = 10.0

tracer = trace.get_tracer("tandem.router")


class _TryNextCell(Exception):
    """The chosen cell was unavailable before it answered; the request may go elsewhere."""


class RouterServicer(generate_pb2_grpc.GenerationServicer):
    """Routes Generate by cache affinity, sums CacheStats over the cells, and answers
    GetModelInfo from one of them."""

    def __init__(self, pool: CellPool, block_size: int) -> None:
        self.pool = pool
        self.balancer: Balancer = pool.balancer
        self.block_size = block_size

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        key = routing_key(request, self.block_size)
        parent = _parent_context(context)
        tried: list[str] = []
        while (decision := self.balancer.route(key, exclude=tried)) is not None:
            span = tracer.start_span("tandem.route", context=parent, kind=trace.SpanKind.CLIENT,
                                     attributes={**decision.span_attributes(),
                                                 "tandem.route.attempt": len(tried) + 1})
            relay = self._relay(decision, request, context, span)
            try:
                async with contextlib.aclosing(relay):
                    async for msg in relay:
                        yield msg
                return
            except _TryNextCell:
                tried.append(decision.cell)
            finally:
                self.balancer.release(decision.cell)
                span.end()
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            "no cell is serving" if not tried else
                            f"no cell could take the request (tried {len(tried)})")

    async def _relay(self, decision: RouteDecision, request: generate_pb2.GenerateRequest,
                     context: grpc.aio.ServicerContext,
                     span: trace.Span) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        call = self.pool.stubs[decision.cell].Generate(
            request, timeout=context.time_remaining(), metadata=tuple(carrier.items()))
        sent = False
        try:
            async for msg in call:
                if not sent:
                    upstream = tuple(await call.initial_metadata() or ())
                    await context.send_initial_metadata((*upstream, (CELL_HEADER, decision.cell)))
                    sent = True
                yield msg
        except grpc.aio.AioRpcError as exc:
            span.set_status(trace.Status(trace.StatusCode.ERROR, exc.code().name))
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.pool.mark_down(decision.cell, f"Generate failed: {exc.details()}")
                if not sent:
                    raise _TryNextCell from exc
            await context.abort(exc.code(), exc.details() or "",
                                trailing_metadata=tuple(exc.trailing_metadata() or ()))
        finally:
            call.cancel()  # no-op once finished; stops the cell's work when we are cancelled

    async def CacheStats(self, request: generate_pb2.CacheStatsRequest,
                         context: grpc.aio.ServicerContext) -> generate_pb2.CacheStatsResponse:
        cells = self.balancer.cells
        remaining = context.time_remaining()
        timeout = STATS_TIMEOUT_S if remaining is None else min(remaining, STATS_TIMEOUT_S)
        results = await asyncio.gather(*(self._cell_stats(c, timeout) for c in cells))
        reached = [s for s in results if s is not None]
        if not reached:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no cell answered CacheStats")
        context.set_trailing_metadata(per_cell_metadata(dict(zip(cells, results, strict=True))))
        return aggregate(reached)

    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext,
                           ) -> generate_pb2.GetModelInfoResponse:
        """One healthy cell's answer (every cell of a deployment serves the same model),
        its name in ``x-tandem-cell``; the next healthy cell is asked if one fails."""
        remaining = context.time_remaining()
        timeout = STATS_TIMEOUT_S if remaining is None else min(remaining, STATS_TIMEOUT_S)
        for cell in [c for c in self.balancer.cells if c in self.balancer.healthy]:
            try:
                info = await self.pool.stubs[cell].GetModelInfo(request, timeout=timeout)
            except grpc.aio.AioRpcError:
                continue
            context.set_trailing_metadata(((CELL_HEADER, cell),))
            return info
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no cell answered GetModelInfo")

    async def _cell_stats(self, cell: str,
                          timeout: float) -> generate_pb2.CacheStatsResponse | None:
        try:
            return await self.pool.stubs[cell].CacheStats(generate_pb2.CacheStatsRequest(),
                                                          timeout=timeout)
        except grpc.aio.AioRpcError:
            return None


def _parent_context(context: grpc.aio.ServicerContext) -> otel_context.Context:
    """The request's trace: the current span if a server interceptor started one, else
    the W3C ``traceparent`` the client sent (so router spans join the caller's trace)."""
    if trace.get_current_span().get_span_context().is_valid:
        return otel_context.get_current()
    carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    return propagate.extract(carrier)
