"""tandem.v1.Generation in front of many cells: route, stream through, aggregate stats.

Generate goes through the Forwarder (:mod:`router_svc.forwarding`, shared with the HTTP
API): a cell picked by the balancer, its stream relayed unchanged, failover while nothing
was sent, the upstream call cancelled with the client's. This adapter adds what belongs
to the gRPC call: the cell's initial metadata (``x-request-id``) plus ``x-tandem-cell``
naming the cell, the client's remaining deadline as the upstream timeout, and on failure
the cell's status code, details and trailing metadata (the ``ErrorInfo``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from router_svc.balancer import Balancer
from router_svc.cell_pool import CellPool
from router_svc.forwarding import Forwarder
from tandem.cell_stats import aggregate, per_cell_metadata
from tandem.v1 import generate_pb2, generate_pb2_grpc

CELL_HEADER = "x-tandem-cell"
STATS_TIMEOUT_S = 10.0


class RouterServicer(generate_pb2_grpc.GenerationServicer):
    """Routes Generate by cache affinity, sums CacheStats over the cells, and answers
    GetModelInfo from one of them."""

    def __init__(self, pool: CellPool, forwarder: Forwarder) -> None:
        self.pool = pool
        self.balancer: Balancer = pool.balancer
        self.forwarder = forwarder

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        async def started(upstream: tuple[tuple[str, str | bytes], ...], cell: str) -> None:
            await context.send_initial_metadata((*upstream, (CELL_HEADER, cell)))

        stream = self.forwarder.generate(request, _parent_context(context),
                                         context.time_remaining(), started)
        try:
            async with contextlib.aclosing(stream):
                async for msg in stream:
                    yield msg
        except grpc.aio.AioRpcError as exc:  # the cell's status, passed through as it is
            await context.abort(exc.code(), exc.details() or "",
                                trailing_metadata=tuple(exc.trailing_metadata() or ()))

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
        its name in ``x-tandem-cell``; the next healthy cell is asked if one fails
        (none: UNAVAILABLE, mapped by the interceptor)."""
        remaining = context.time_remaining()
        timeout = STATS_TIMEOUT_S if remaining is None else min(remaining, STATS_TIMEOUT_S)
        info, cell = await self.forwarder.model_info(timeout)
        context.set_trailing_metadata(((CELL_HEADER, cell),))
        return info

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
