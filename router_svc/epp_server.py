"""The endpoint picker's process (``tandem epp``): ext_proc, health, metrics, shutdown."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry, Counter

from router_svc.balancer import Balancer
from router_svc.cell_pool import MAX_MESSAGE_BYTES, CellPool
from router_svc.epp import (
    SERVICE_NAME,
    CellEndpoint,
    EppServicer,
    Picker,
    ext_proc_handler,
    resolved,
)
from router_svc.metrics import start_metrics
from tandem.grpc_server import GrpcServer, tcp_binder, tls_mode
from tandem.metrics import MetricsEndpoint
from tandem.shutdown import DEFAULT_GRACE_S, serve_until_signalled
from tandem.tls import TlsFiles, channel_credentials, server_credentials

log = logging.getLogger(__name__)

# The health services GIE's EPP answers besides the ext_proc one: the process is alive, and
# ready to pick (its first round of cell checks is done).
LIVENESS, READINESS = "liveness", "readiness"


@dataclass(frozen=True)
class EppConfig:
    """Settings of ``tandem epp`` (flags and TANDEM_* variables in docs/configuration.md).

    ``load_factor``, ``block_size``, ``health_interval``, ``tls`` (the ext_proc port) and
    ``cell_tls`` (toward the cells) mean what they mean for ``tandem router``.
    ``queue_bound``: a cell reporting this many requests in flight takes no more (0 = no
    bound); when every eligible cell is there, the answer is 429. ``body_timeout_s``
    bounds the wait for a request's body.
    """

    cells: tuple[CellEndpoint, ...]
    listen: str = "localhost:9002"
    load_factor: float = 1.25
    block_size: int = 16
    health_interval: float = 1.0
    queue_bound: int = 0
    body_timeout_s: float = 30.0
    metrics_port: int = 0
    shutdown_grace_s: float = DEFAULT_GRACE_S
    tls: TlsFiles = field(default_factory=TlsFiles)
    cell_tls: TlsFiles = field(default_factory=TlsFiles)
    health_listen: str = ""


@dataclass
class EppServer:
    grpc: GrpcServer
    port: int
    pool: CellPool
    picker: Picker
    metrics: MetricsEndpoint | None = None

    @property
    def balancer(self) -> Balancer:
        return self.pool.balancer

    async def stop(self, grace: float) -> None:
        """NOT_SERVING (Envoy's health check stops sending new streams), running streams
        finish within ``grace``, then the cell channels close."""
        await self.grpc.stop(grace)
        await self.pool.close()
        if self.metrics is not None:
            await self.metrics.close()


async def create_epp(config: EppConfig) -> EppServer:
    """Start serving; returns after one round of cell checks. Bad TLS files raise
    TlsConfigError, unresolvable cell hosts OSError, before anything starts."""
    if not config.cells:
        raise ValueError("the endpoint picker needs at least one cell")
    credentials = server_credentials(config.tls)
    cell_credentials = channel_credentials(config.cell_tls) if config.cell_tls.enabled else None
    cells = await asyncio.gather(*(resolved(c) for c in config.cells))
    balancer = Balancer([c.name for c in cells], config.load_factor,
                        queue_bound=config.queue_bound)
    picker = Picker(balancer, cells)
    registry = CollectorRegistry()
    refused = Counter("tandem_epp_refused", "Requests the endpoint picker answered itself "
                      "(no cell up, queues full, body too slow), by HTTP status",
                      ["status"], registry=registry)
    server = GrpcServer.create(SERVICE_NAME, [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000)], trace_calls=False)
    server.server.add_generic_rpc_handlers((ext_proc_handler(
        EppServicer(picker, config.block_size, config.body_timeout_s, refused)),))
    pool = CellPool(balancer, config.health_interval, credentials=cell_credentials)
    port = await server.start(tcp_binder(config.listen, credentials), config.health_listen)
    await server.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    await pool.start()
    await server.set_serving(True)
    await server.health.set(READINESS, health_pb2.HealthCheckResponse.SERVING)
    metrics = (await start_metrics(balancer, config.metrics_port, registry)
               if config.metrics_port else None)
    log.info("endpoint picker serving %s on port %d, %s, over %d cells (%d up%s)",
             SERVICE_NAME, port, tls_mode(credentials, config.tls.ca), len(cells),
             len(balancer.healthy), ", TLS" if cell_credentials else "")
    return EppServer(server, port, pool, picker, metrics)


async def serve(config: EppConfig) -> None:
    """Run until SIGTERM or SIGINT, then shut down in order (see EppServer.stop)."""
    await serve_until_signalled(
        create_epp(config), f"tandem epp listening on {config.listen} over "
        f"{len(config.cells)} cells", config.shutdown_grace_s)
