"""The endpoint picker's process (``tandem epp``): ext_proc, health, metrics, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
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
    parse_cells,
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

    ``load_factor``: a cell above this many times the mean in-flight count spills;
    ``block_size``: the cells' KV block size (a text prompt's key is its first block);
    ``health_interval``: seconds between checks of every cell; ``tls`` serves the ext_proc
    port; ``cell_tls`` are the client credentials toward the cells (all empty = plaintext).
    ``cells_file``: read the cells from this file instead of ``cells``, and again
    whenever it changes. ``queue_bound``: a cell reporting this many requests in flight
    takes no more (0 = no bound); when every eligible cell is there, the answer is 429.
    ``body_timeout_s`` bounds the wait for a request's body.
    """

    cells: tuple[CellEndpoint, ...] = ()
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
    cells_file: str = ""  # when set, the cells come from it (re-read on change)
    http_port: int = 8000  # the cells file's entries without an HTTP port


@dataclass
class CellSet:
    """The cells the picker serves now: the picker over them, the pool checking them and
    the task resolving their hosts again every health interval."""

    picker: Picker
    pool: CellPool
    resolver: asyncio.Task[None]

    @classmethod
    async def start(cls, cells: Sequence[CellEndpoint], config: EppConfig,
                    credentials: grpc.ChannelCredentials | None) -> CellSet:
        """Resolve the hosts (one that does not resolve yet is left out until it does)
        and run one round of checks."""
        if not cells:
            raise ValueError("the endpoint picker needs at least one cell")
        balancer = Balancer([c.name for c in cells], config.load_factor,
                            queue_bound=config.queue_bound)
        picker = Picker(balancer, cells)
        await picker.resolve()
        pool = CellPool(balancer, config.health_interval, credentials=credentials)
        await pool.start()

        async def resolve_again() -> None:
            while True:
                await asyncio.sleep(config.health_interval)
                await picker.resolve()

        return cls(picker, pool, asyncio.create_task(resolve_again(), name="cell-addresses"))

    async def close(self) -> None:
        self.resolver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.resolver
        await self.pool.close()


class CellsFile:
    """``--cells-file``: the ``--cells`` syntax (commas or newlines), read again when the
    file changes (its size or modification time)."""

    def __init__(self, path: str, default_http_port: int) -> None:
        self.path = Path(path)
        self.default_http_port = default_http_port
        self._seen: tuple[int, int] | None = None

    def changed(self) -> bool:
        st = self.path.stat()
        return (st.st_mtime_ns, st.st_size) != self._seen

    def read(self) -> tuple[CellEndpoint, ...]:
        """The cells now in the file (OSError, ValueError when it is unreadable or bad)."""
        st = self.path.stat()
        cells = parse_cells(self.path.read_text().replace("\n", ","), self.default_http_port)
        self._seen = (st.st_mtime_ns, st.st_size)
        return cells


@dataclass
class EppServer:
    grpc: GrpcServer
    port: int
    servicer: EppServicer
    cells: CellSet
    metrics: MetricsEndpoint | None = None
    watcher: asyncio.Task[None] | None = None

    @property
    def picker(self) -> Picker:
        return self.servicer.picker

    @property
    def balancer(self) -> Balancer:
        return self.servicer.picker.balancer

    async def follow(self, file: CellsFile, current: tuple[CellEndpoint, ...],
                     config: EppConfig, credentials: grpc.ChannelCredentials | None) -> None:
        """Switch to the file's cells whenever they change from ``current``; a bad file
        keeps the current ones. Streams already picked finish on the cells they were
        given."""
        while True:
            await asyncio.sleep(config.health_interval)
            try:
                if not file.changed() or (cells := file.read()) == current:
                    continue
                new = await CellSet.start(cells, config, credentials)
            except (OSError, ValueError) as exc:
                log.warning("cells file %s: %s; keeping the current %d cells", file.path, exc,
                            len(self.balancer.cells))
                continue
            current, old, self.cells = cells, self.cells, new
            self.servicer.picker = new.picker
            await old.close()
            log.warning("cells file %s: now %d cells (%d up)", file.path, len(cells),
                        len(new.picker.balancer.healthy))

    async def stop(self, grace: float) -> None:
        """NOT_SERVING (Envoy's health check stops sending new streams), running streams
        finish within ``grace``, then the cell channels close."""
        if self.watcher is not None:
            self.watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.watcher
        await self.grpc.stop(grace)
        await self.cells.close()
        if self.metrics is not None:
            await self.metrics.close()


async def create_epp(config: EppConfig) -> EppServer:
    """Start serving; returns after one round of cell checks. Bad TLS files raise
    TlsConfigError, a bad cells file OSError or ValueError, before anything starts; a cell
    host that does not resolve yet is only left out until it does (:class:`Picker`)."""
    credentials = server_credentials(config.tls)
    cell_credentials = channel_credentials(config.cell_tls) if config.cell_tls.enabled else None
    file = CellsFile(config.cells_file, config.http_port) if config.cells_file else None
    initial = file.read() if file else config.cells
    cells = await CellSet.start(initial, config, cell_credentials)
    registry = CollectorRegistry()
    refused = Counter("tandem_epp_refused", "Requests the endpoint picker answered itself "
                      "(no cell up, queues full, body too slow), by HTTP status",
                      ["status"], registry=registry)
    server = GrpcServer.create(SERVICE_NAME, [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000)], trace_calls=False)
    servicer = EppServicer(cells.picker, config.block_size, config.body_timeout_s, refused)
    server.server.add_generic_rpc_handlers((ext_proc_handler(servicer),))
    try:
        port = await server.start(tcp_binder(config.listen, credentials), config.health_listen)
    except BaseException:
        await cells.close()
        raise
    for name in (LIVENESS, READINESS):
        await server.health.set(name, health_pb2.HealthCheckResponse.SERVING)
    await server.set_serving(True)
    running = EppServer(server, port, servicer, cells)
    if config.metrics_port:
        running.metrics = await start_metrics(lambda: running.balancer, config.metrics_port,
                                              registry)
    if file is not None:
        running.watcher = asyncio.create_task(running.follow(file, initial, config,
                                                                  cell_credentials),
                                              name="cells-file")
    log.info("endpoint picker serving %s on port %d, %s, over %d cells (%d up%s)",
             SERVICE_NAME, port, tls_mode(credentials, config.tls.ca),
             len(running.balancer.cells), len(running.balancer.healthy),
             ", TLS" if cell_credentials else "")
    return running


async def serve(config: EppConfig) -> None:
    """Run until SIGTERM or SIGINT, then shut down in order (see EppServer.stop)."""
    cells = f"the cells of {config.cells_file}" if config.cells_file else \
        f"{len(config.cells)} cells"
    await serve_until_signalled(
        create_epp(config), f"tandem epp listening on {config.listen} over {cells}",
        config.shutdown_grace_s)
