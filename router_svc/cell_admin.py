"""``tandem.v1``'s admin calls answered for many cells at once: CacheStats and GetModelInfo.

In front of several cells a client still wants one answer: ``CacheStats`` is the sum over
the cells that answered, each cell's own figures in the trailing metadata
(:mod:`tandem.cell_stats`, read back by ``tandem stats --per-cell``); ``GetModelInfo`` is
one healthy cell's answer (every cell of a deployment serves the same model), with that
cell's name in the trailing ``x-tandem-cell``. The endpoint picker serves them on its gRPC
port (the Envoy bootstrap routes these two paths to it).

NOTE: the cells are asked at call time, bounded by the caller's deadline and
:data:`ADMIN_TIMEOUT_S`, rather than answered from the ``CacheStats`` the pool polls every
health interval: a reading up to an interval old would miss the request a user just sent
before running ``tandem stats``, and the admin calls are rare.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from router_svc.cell_pool import CellPool
from tandem.cell_stats import CELL_HEADER, Metadata, aggregate, per_cell_metadata
from tandem.errors import Unavailable
from tandem.v1 import generate_pb2, generate_pb2_grpc

ADMIN_TIMEOUT_S = 10.0


def call_timeout(context: grpc.aio.ServicerContext) -> float:
    """The upstream timeout of an admin call: the caller's remaining time, at most
    :data:`ADMIN_TIMEOUT_S` (a caller without a deadline must not wait on a hung cell)."""
    remaining = context.time_remaining()
    return ADMIN_TIMEOUT_S if remaining is None else min(remaining, ADMIN_TIMEOUT_S)


async def cache_stats(pool: CellPool, timeout: float,
                      ) -> tuple[generate_pb2.CacheStatsResponse, Metadata]:
    """Every cell's CacheStats summed, and the per-cell trailing metadata (cells that did
    not answer within ``timeout`` listed as unreachable); Unavailable when none answered."""
    cells = pool.balancer.cells

    async def one(cell: str) -> generate_pb2.CacheStatsResponse | None:
        try:
            return await pool.stubs[cell].CacheStats(generate_pb2.CacheStatsRequest(),
                                                     timeout=timeout)
        except grpc.aio.AioRpcError:
            return None

    results = await asyncio.gather(*(one(c) for c in cells))
    reached = [s for s in results if s is not None]
    if not reached:
        raise Unavailable("no cell answered CacheStats")
    return aggregate(reached), per_cell_metadata(dict(zip(cells, results, strict=True)))


async def model_info(pool: CellPool, timeout: float,
                     ) -> tuple[generate_pb2.GetModelInfoResponse, str]:
    """The first healthy cell's model info (ring order) and its name; the next healthy cell
    is asked if one fails; Unavailable when none answers."""
    balancer = pool.balancer
    for cell in [c for c in balancer.cells if c in balancer.healthy]:
        try:
            info = await pool.stubs[cell].GetModelInfo(generate_pb2.GetModelInfoRequest(),
                                                       timeout=timeout)
        except grpc.aio.AioRpcError:
            continue
        return info, cell
    raise Unavailable("no cell answered GetModelInfo")


class CellAdminServicer(generate_pb2_grpc.GenerationServicer):
    """CacheStats and GetModelInfo over the cells of ``pool()`` (a function: the picker's
    cells may be replaced while it runs). Generate is not served here (UNIMPLEMENTED);
    the router's servicer adds it. Failures raise ``tandem.errors`` for the server's one
    error-mapping interceptor."""

    def __init__(self, pool: Callable[[], CellPool]) -> None:
        self.pool = pool

    async def CacheStats(self, request: generate_pb2.CacheStatsRequest,
                         context: grpc.aio.ServicerContext) -> generate_pb2.CacheStatsResponse:
        stats, per_cell = await cache_stats(self.pool(), call_timeout(context))
        context.set_trailing_metadata(per_cell)
        return stats

    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext,
                           ) -> generate_pb2.GetModelInfoResponse:
        info, cell = await model_info(self.pool(), call_timeout(context))
        context.set_trailing_metadata(((CELL_HEADER, cell),))
        return info
