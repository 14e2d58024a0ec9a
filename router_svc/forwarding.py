"""One Generate forwarded to a cell, free of any server's call context.

The balancer picks the cell; the cell's stream is relayed as it comes. A cell that fails
with UNAVAILABLE before sending anything never started the answer, so it is marked down
and the request goes to the next cell of its ring order (a ``failover``); once a message
went out a retry would duplicate output, so the error passes through. Closing the
iterator (the client left) cancels the upstream call, so the cell frees the request's KV
blocks at once. Each attempt is a ``tandem.route`` CLIENT span whose context travels to
the cell as ``traceparent``.

Used by the router's gRPC servicer and its HTTP backend; errors come out as the cell's
``grpc.aio.AioRpcError``, or ``Unavailable`` when no cell could take the request.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from router_svc.balancer import RouteDecision
from router_svc.cell_admin import ADMIN_TIMEOUT_S, model_info
from router_svc.cell_pool import CellPool
from router_svc.routing_key import routing_key
from tandem.errors import Unavailable
from tandem.v1 import generate_pb2

tracer = trace.get_tracer("tandem.router")

# Called once per request with the serving cell's initial metadata and its name, right
# before its first message is relayed.
OnStart = Callable[[tuple[tuple[str, str | bytes], ...], str], Awaitable[None]]


class _TryNextCell(Exception):
    """The chosen cell was unavailable before it answered; the request may go elsewhere."""


class Forwarder:
    """Routes requests over ``pool``'s cells (``block_size``: the cells' KV block size;
    ``served_model_names``: the model's names in the router's answers, empty = the cells')."""

    def __init__(self, pool: CellPool, block_size: int,
                 served_model_names: Sequence[str] = ()) -> None:
        self.pool = pool
        self.balancer = pool.balancer
        self.block_size = block_size
        self.served_model_names = tuple(served_model_names)

    async def generate(self, request: generate_pb2.GenerateRequest,
                       parent: otel_context.Context, timeout: float | None = None,
                       on_start: OnStart | None = None,
                       ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        key = routing_key(request, self.block_size)
        tried: list[str] = []
        while (decision := self.balancer.route(key, exclude=tried)) is not None:
            span = tracer.start_span("tandem.route", context=parent, kind=trace.SpanKind.CLIENT,
                                     attributes={**decision.span_attributes(),
                                                 "tandem.route.attempt": len(tried) + 1})
            relay = self._relay(decision, request, timeout, span, on_start)
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
        raise Unavailable("no cell is serving" if not tried else
                          f"no cell could take the request (tried {len(tried)})")

    async def _relay(self, decision: RouteDecision, request: generate_pb2.GenerateRequest,
                     timeout: float | None, span: trace.Span, on_start: OnStart | None,
                     ) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        call = self.pool.stubs[decision.cell].Generate(
            request, timeout=timeout, metadata=tuple(carrier.items()))
        sent = False
        try:
            async for msg in call:
                if not sent:
                    if on_start is not None:
                        await on_start(tuple(await call.initial_metadata() or ()), decision.cell)
                    sent = True
                yield msg
        except grpc.aio.AioRpcError as exc:
            span.set_status(trace.Status(trace.StatusCode.ERROR, exc.code().name))
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.pool.mark_down(decision.cell, f"Generate failed: {exc.details()}")
                if not sent:
                    raise _TryNextCell from exc
            raise
        finally:
            call.cancel()  # no-op once finished; stops the cell's work when we are cancelled

    async def model_info(self, timeout: float = ADMIN_TIMEOUT_S,
                         ) -> tuple[generate_pb2.GetModelInfoResponse, str]:
        """One healthy cell's model info and its name (:func:`router_svc.cell_admin.model_info`),
        under the router's served model names when it has its own."""
        info, cell = await model_info(self.pool, timeout)
        if self.served_model_names:
            info.model_id = self.served_model_names[0]
            del info.served_model_names[:]
            info.served_model_names.extend(self.served_model_names)
        return info, cell
