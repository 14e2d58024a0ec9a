"""tandem.v1.Generation in front of many cells: route, stream through, aggregate stats.

Generate goes through the Forwarder (:mod:`router_svc.forwarding`, shared with the HTTP
API): a cell picked by the balancer, its stream relayed unchanged, failover while nothing
was sent, the upstream call cancelled with the client's. This adapter adds what belongs
to the gRPC call: the cell's initial metadata (``x-request-id``) plus ``x-tandem-cell``
naming the cell, the client's remaining deadline as the upstream timeout, and on failure
the cell's status code, details and trailing metadata (the ``ErrorInfo``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from router_svc.balancer import Balancer
from router_svc.cell_admin import CELL_HEADER, CellAdminServicer
from router_svc.cell_pool import CellPool
from router_svc.forwarding import Forwarder
from tandem.v1 import generate_pb2


class RouterServicer(CellAdminServicer):
    """Routes Generate by cache affinity; CacheStats and GetModelInfo as the picker answers
    them (:mod:`router_svc.cell_admin`)."""

    def __init__(self, pool: CellPool, forwarder: Forwarder) -> None:
        super().__init__(lambda: pool)
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

    async def model_info(self, timeout: float) -> tuple[generate_pb2.GetModelInfoResponse, str]:
        return await self.forwarder.model_info(timeout)  # under the router's model names


def _parent_context(context: grpc.aio.ServicerContext) -> otel_context.Context:
    """The request's trace: the current span if a server interceptor started one, else
    the W3C ``traceparent`` the client sent (so router spans join the caller's trace)."""
    if trace.get_current_span().get_span_context().is_valid:
        return otel_context.get_current()
    carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    return propagate.extract(carrier)
