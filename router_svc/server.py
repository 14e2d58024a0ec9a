"""The router process: the public Generation API, health, reflection, the OpenAI-compatible
HTTP port (forwarded to the cells like Generate), graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from router_svc.balancer import Balancer
from router_svc.cell_pool import MAX_MESSAGE_BYTES, SERVICE_NAME, CellPool
from router_svc.forwarding import Forwarder
from router_svc.http_backend import RouterBackend
from router_svc.metrics import start_metrics
from router_svc.servicer import RouterServicer
from tandem.grpc_server import GrpcServer, tcp_binder, tls_mode
from tandem.metrics import MetricsEndpoint
from tandem.openai_api.http_server import HttpConfig, HttpServer
from tandem.request_limits import max_http_body_bytes
from tandem.shutdown import DEFAULT_GRACE_S, serve_until_signalled
from tandem.tls import TlsFiles, channel_credentials, server_credentials
from tandem.v1 import generate_pb2_grpc

log = logging.getLogger(__name__)


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
    shutdown_grace_s: float = DEFAULT_GRACE_S  # running streams may finish (tandem.shutdown)
    tls: TlsFiles = field(default_factory=TlsFiles)
    cell_tls: TlsFiles = field(default_factory=TlsFiles)
    health_listen: str = ""  # extra plaintext port with health only (probes under TLS)
    http: HttpConfig = field(default_factory=HttpConfig)  # OpenAI-compatible port (TLS: tls)
    # The model's names in the router's answers (--served-model-name); empty = the cells'.
    served_model_names: tuple[str, ...] = ()


@dataclass
class RouterServer:
    grpc: GrpcServer
    port: int
    pool: CellPool
    metrics: MetricsEndpoint | None = None
    http: HttpServer | None = None

    @property
    def balancer(self) -> Balancer:
        return self.pool.balancer

    async def stop(self, grace: float) -> None:
        """Health NOT_SERVING -> refuse new calls, let in-flight streams finish (up to
        ``grace``; the rest are cancelled, which cancels them on their cells) -> stop
        polling and close the cell channels. The HTTP port drains alongside."""
        await asyncio.gather(self.grpc.stop(grace),
                             *([self.http.stop(grace)] if self.http is not None else []))
        await self.pool.close()
        if self.metrics is not None:
            await self.metrics.close()


async def create_router(config: RouterConfig) -> RouterServer:
    """Start serving; returns after one round of cell health checks. Bad TLS files raise
    TlsConfigError before anything starts."""
    credentials = server_credentials(config.tls)
    cell_credentials = channel_credentials(config.cell_tls) if config.cell_tls.enabled else None
    balancer = Balancer(config.cells, config.load_factor)
    public = GrpcServer.create(SERVICE_NAME, [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000)])

    async def publish() -> None:
        await public.set_serving(bool(balancer.healthy))

    def on_change() -> None:
        asyncio.get_running_loop().create_task(publish())

    pool = CellPool(balancer, config.health_interval, on_change, cell_credentials)
    forwarder = Forwarder(pool, config.block_size, config.served_model_names)
    generate_pb2_grpc.add_GenerationServicer_to_server(RouterServicer(pool, forwarder),
                                                       public.server)
    port = await public.start(tcp_binder(config.listen, credentials), config.health_listen)
    await pool.start()
    await publish()
    http = None
    if config.http.listen:
        try:
            http = await HttpServer.start(RouterBackend(forwarder), config.http, config.tls,
                                          max_http_body_bytes(MAX_MESSAGE_BYTES))
        except BaseException:
            await public.stop(0)
            await pool.close()
            raise
    metrics = await start_metrics(balancer, config.metrics_port) if config.metrics_port else None
    log.info("router serving %s on port %d, %s, over %d cells (%d up%s), load factor %.2f",
             SERVICE_NAME, port, tls_mode(credentials, config.tls.ca), len(config.cells),
             len(balancer.healthy), ", TLS" if cell_credentials else "", config.load_factor)
    if http is not None:
        log.info("router serving the OpenAI-compatible HTTP API on port %d", http.port)
    return RouterServer(public, port, pool, metrics, http)


async def serve(config: RouterConfig) -> None:
    """Run until SIGTERM or SIGINT, then shut down in order (see RouterServer.stop)."""
    await serve_until_signalled(
        create_router(config), f"tandem router listening on {config.listen} over "
        f"{len(config.cells)} cells", config.shutdown_grace_s)
