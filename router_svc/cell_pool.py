"""The endpoint picker's cells: one channel each, and the loop that tracks their health.

A cell is up while its health service reports ``tandem.v1.Generation`` SERVING (the
scheduler says so only once its workers are ready, and stops saying so when it begins to
shut down). A failed check (refused, timed out) marks it down at once; the next check that
sees SERVING brings it back, and with it its keys. Each check of a serving cell also reads
its ``CacheStats``: the cell's own count of requests in flight (all clients') is the
balancer's queue for that cell.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router_svc.balancer import Balancer
from tandem.v1 import generate_pb2, generate_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# The cell enforces its own request limits (8 images of 20 MiB by default); the picker
# must never be the smaller limit, so it allows more than any cell would accept.
MAX_MESSAGE_BYTES = 256 * 2**20
# A busy cell can answer a health check slowly; a short timeout would flap it.
HEALTH_TIMEOUT_S = 3.0
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # NOTE: gRPC's default reconnect backoff grows to 120 s; a returning cell would stay
    # unreachable that long after its health check already says SERVING.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 30_000),
]


class CellPool:
    """Channels and stubs per cell, plus the health poller that feeds the balancer.

    ``credentials`` (None = plaintext) are used toward every cell.
    """

    def __init__(self, balancer: Balancer, interval: float = 1.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.balancer = balancer
        self.interval = interval
        self._channels = {
            cell: (grpc.aio.secure_channel(cell, credentials, options=CHANNEL_OPTIONS)
                   if credentials else grpc.aio.insecure_channel(cell, options=CHANNEL_OPTIONS))
            for cell in balancer.cells}
        self.stubs = {cell: generate_pb2_grpc.GenerationStub(ch)
                      for cell, ch in self._channels.items()}
        self._health = {cell: health_pb2_grpc.HealthStub(ch)
                        for cell, ch in self._channels.items()}
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """One round of checks (so routing starts with a real view), then poll forever."""
        await self.check_all()
        self._poller = asyncio.create_task(self._poll(), name="cell-health")

    async def check_all(self) -> None:
        cells = self.balancer.cells
        results = await asyncio.gather(*(self._serving(c) for c in cells))
        for cell, serving in zip(cells, results, strict=True):
            self._set(cell, serving, "health check")
        live = [c for c, serving in zip(cells, results, strict=True) if serving]
        stats = await asyncio.gather(*(self._stats(c) for c in live))
        for cell, reply in zip(live, stats, strict=True):
            if reply is not None:
                self.balancer.set_queued(cell, reply.requests_in_flight)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await asyncio.gather(*(ch.close() for ch in self._channels.values()))

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check_all()

    async def _serving(self, cell: str) -> bool:
        try:
            reply = await self._health[cell].Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=HEALTH_TIMEOUT_S)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def _stats(self, cell: str) -> generate_pb2.CacheStatsResponse | None:
        """The cell's live state; None when it does not answer in time (its health
        decides whether it is up; its last reported queue stays)."""
        try:
            return await self.stubs[cell].CacheStats(generate_pb2.CacheStatsRequest(),
                                                     timeout=HEALTH_TIMEOUT_S)
        except grpc.RpcError:
            return None

    def _set(self, cell: str, serving: bool, why: str) -> None:
        if self.balancer.set_healthy(cell, serving):
            log.warning("cell %s is %s (%s)", cell, "up" if serving else "down", why)
