"""The router process: the public Generation API, health, reflection, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from router_svc.balancer import Balancer
from router_svc.cell_pool import MAX_MESSAGE_BYTES, SERVICE_NAME, CellPool
from router_svc.metrics import BalancerCollector
from router_svc.servicer import RouterServicer
from tandem import tracing
from tandem.errors import ErrorMappingInterceptor
from tandem.health_port import HealthPort
from tandem.metrics import MetricsEndpoint
from tandem.tls import TlsFiles, channel_credentials, server_credentials
from tandem.v1 import generate_pb2_grpc

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0


@dataclass(frozen=True)
class RouterConfig:
    """Settings of ``tandem router`` (flags and TANDEM_* variables in docs/configuration.md).

    ``block_size`` must equal the cells' KV block size, so that a text prompt's key covers
    exactly the first block the cells cache. ``tls`` serves the public port (``ca`` = the
    client CA: mutual TLS), as the scheduler's does; ``cell_tls`` are the client credentials
    toward the cells (``ca`` = the CA of their certificates; ``cert`` + ``key`` when they
    ask for mutual TLS); all empty = plaintext.
    """

    cells: tuple[str, ...]
    listen: str = "localhost:50050"
    load_factor: float = 1.25
    block_size: int = 16
    health_interval: float = 1.0
    metrics_port: int = 0  # Prometheus /metrics (0 = off)
    tls: TlsFiles = field(default_factory=TlsFiles)
    cell_tls: TlsFiles = field(default_factory=TlsFiles)
    health_listen: str = ""  # extra plaintext port with health only (probes under TLS)


@dataclass
class RouterServer:
    server: grpc.aio.Server
    port: int
    pool: CellPool
    health: health.aio.HealthServicer
    metrics: MetricsEndpoint | None = None
    probes: HealthPort | None = None

    @property
    def balancer(self) -> Balancer:
        return self.pool.balancer

    async def stop(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        """Health NOT_SERVING -> refuse new calls, let in-flight streams finish (up to
        ``grace``; the rest are cancelled, which cancels them on their cells) -> stop
        polling and close the cell channels."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.probes is not None:
            await self.probes.stop()
        await self.pool.close()
        if self.metrics is not None:
            await self.metrics.close()


async def create_router(config: RouterConfig) -> RouterServer:
    """Start serving; returns after one round of cell health checks. Bad TLS files raise
    TlsConfigError before anything starts."""
    credentials = server_credentials(config.tls)
    cell_credentials = channel_credentials(config.cell_tls) if config.cell_tls.enabled else None
    health_servicer = health.aio.HealthServicer()
    balancer = Balancer(config.cells, config.load_factor)

    async def publish() -> None:
        serving = bool(balancer.healthy)
        await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING
                                  if serving else health_pb2.HealthCheckResponse.NOT_SERVING)

    def on_change() -> None:
        asyncio.get_running_loop().create_task(publish())

    pool = CellPool(balancer, config.health_interval, on_change, cell_credentials)
    interceptors: list[grpc.aio.ServerInterceptor] = [ErrorMappingInterceptor()]
    if tracing.enabled():  # route spans then join the server span of the client's trace
        interceptors.insert(0, tracing.ServerSpanInterceptor([SERVICE_NAME]))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.keepalive_permit_without_calls", 1),
                 ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000)])
    generate_pb2_grpc.add_GenerationServicer_to_server(
        RouterServicer(pool, config.block_size), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await publish()
    port = (server.add_secure_port(config.listen, credentials) if credentials
            else server.add_insecure_port(config.listen))
    await server.start()
    probes = await HealthPort.start(health_servicer, config.health_listen)
    await pool.start()
    await publish()
    metrics = None
    if config.metrics_port:
        registry = CollectorRegistry()
        registry.register(BalancerCollector(balancer))
        metrics = await MetricsEndpoint.start(registry, config.metrics_port)
    tls = "mutual TLS" if config.tls.ca else "TLS" if credentials else "plaintext"
    log.info("router serving %s on port %d, %s, over %d cells (%d up%s), load factor %.2f",
             SERVICE_NAME, port, tls, len(config.cells), len(balancer.healthy),
             ", TLS" if cell_credentials else "", config.load_factor)
    return RouterServer(server, port, pool, health_servicer, metrics, probes)


async def serve(config: RouterConfig) -> None:
    """Run until SIGTERM or SIGINT, then shut down in order (see RouterServer.stop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = await create_router(config)
    print(f"tandem router listening on {config.listen} over {len(config.cells)} cells "
          f"(pid {os.getpid()})", flush=True)
    await stop.wait()
    log.info("shutting down")
    await running.stop()
