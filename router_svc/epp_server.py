"""The endpoint picker's process (``tandem epp``): ext_proc, the cells' admin calls
(:mod:`router_svc.cell_admin`), health, metrics, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry, Counter

from router_svc.balancer import Balancer
from router_svc.cell_admin import CellAdminServicer
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
from router_svc.pool_watch import KubeClient, PoolSource, PoolWatch, connection
from tandem.grpc_server import GrpcServer, tcp_binder, tls_mode
from tandem.metrics import MetricsEndpoint
from tandem.shutdown import DEFAULT_GRACE_S, serve_until_signalled
from tandem.tls import TlsFiles, channel_credentials, server_credentials
from tandem.v1 import generate_pb2_grpc

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
    whenever it changes. ``pool``: follow an InferencePool's pods instead
    (:mod:`router_svc.pool_watch`). ``queue_bound``: a cell reporting this many requests in flight
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
    pool: PoolSource | None = None  # when set, the cells are the pool's ready pods


@dataclass
class CellSet:
    """The cells the picker serves now: the picker over them and the pool checking them.
    Their hosts are resolved again by :meth:`EppServer.follow_addresses`."""

    picker: Picker
    pool: CellPool

    @classmethod
    async def start(cls, cells: Sequence[CellEndpoint], config: EppConfig,
                    credentials: grpc.ChannelCredentials | None) -> CellSet:
        """Resolve the hosts (one that does not resolve yet is left out until it does)
        and run one round of checks. No cells is a set too: an InferencePool may select
        no ready pod; the picker then answers 503."""
        balancer = Balancer([c.name for c in cells], config.load_factor,
                            queue_bound=config.queue_bound)
        picker = Picker(balancer, cells)
        await picker.resolve()
        pool = CellPool(balancer, config.health_interval, credentials=credentials)
        try:
            await pool.start()
        except BaseException:  # cancelled (shutdown) while checking: close the channels
            await pool.close()
            raise
        return cls(picker, pool)

    async def close(self) -> None:
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
        if not cells:
            raise ValueError("the file names no cell")
        self._seen = (st.st_mtime_ns, st.st_size)
        return cells


@dataclass
class EppServer:
    grpc: GrpcServer
    port: int
    servicer: EppServicer
    cells: CellSet
    config: EppConfig
    cell_credentials: grpc.ChannelCredentials | None
    metrics: MetricsEndpoint | None = None
    watcher: asyncio.Task[None] | None = None
    resolver: asyncio.Task[None] | None = None
    # Told the cells (with their addresses) whenever they change: see watch_cells.
    cells_listener: Callable[[tuple[CellEndpoint, ...]], None] | None = None

    @property
    def picker(self) -> Picker:
        return self.servicer.picker

    @property
    def balancer(self) -> Balancer:
        return self.servicer.picker.balancer

    async def use(self, cells: Sequence[CellEndpoint], source: str) -> None:
        """Switch to ``cells``: the one way the cells change, whatever their source.
        Streams already picked finish on the cells they were given."""
        new = await CellSet.start(cells, self.config, self.cell_credentials)
        old, self.cells = self.cells, new
        self.servicer.picker = new.picker
        self._cells_changed()
        await old.close()
        log.warning("%s: now %d cells (%d up)", source, len(cells),
                    len(new.picker.balancer.healthy))

    async def follow_addresses(self) -> None:
        """Resolve the current cells' hosts again every health interval (:class:`Picker`)."""
        while True:
            await asyncio.sleep(self.config.health_interval)
            if await self.picker.resolve():
                self._cells_changed()

    def watch_cells(self, listener: Callable[[tuple[CellEndpoint, ...]], None]) -> None:
        """Call ``listener`` with the cells now, and again whenever the picker's cells or
        their addresses change (:meth:`use` and :meth:`follow_addresses`, the only places
        they change): how ``tandem gateway`` keeps its Envoy's cells the picker's. The
        first call's errors are the caller's; later ones are logged and the next change
        tries again (the resolving and the watch go on)."""
        self.cells_listener = listener
        listener(tuple(self.picker.cells.values()))

    def _cells_changed(self) -> None:
        if self.cells_listener is None:
            return
        try:
            self.cells_listener(tuple(self.picker.cells.values()))
        except Exception:
            log.exception("telling the cells' change failed; retried at the next change")

    async def follow(self, file: CellsFile, current: tuple[CellEndpoint, ...]) -> None:
        """Switch to the file's cells whenever they change from ``current``; a bad file
        keeps the current ones."""
        while True:
            await asyncio.sleep(self.config.health_interval)
            try:
                if not file.changed() or (cells := file.read()) == current:
                    continue
            except (OSError, ValueError) as exc:
                log.warning("cells file %s: %s; keeping the current %d cells", file.path, exc,
                            len(self.balancer.cells))
                continue
            await self.use(cells, f"cells file {file.path}")
            current = cells

    async def watch_pool(self, source: PoolSource) -> None:
        """Follow the pool's ready pods (:class:`router_svc.pool_watch.PoolWatch`); ready
        from the first list of them on. The watch retries what it expects (an unreachable
        API server, a missing pool); anything else ends it, logged, with liveness and
        readiness NOT_SERVING, so that the kubelet restarts a picker whose cells would
        otherwise stay as they are for good."""
        async def publish(cells: tuple[CellEndpoint, ...]) -> None:
            await self.use(cells, watch.pool_name)
            await self.grpc.health.set(READINESS, health_pb2.HealthCheckResponse.SERVING)
            await self.grpc.set_serving(True)

        try:
            config, namespace = await asyncio.to_thread(connection, source)
            client = KubeClient(config)
            watch = PoolWatch(client, namespace, source, self.config.http_port, publish)
            try:
                await watch.run()
            finally:
                await client.close()
        except Exception:
            log.exception("following InferencePool %s stopped", source.pool)
            for name in (LIVENESS, READINESS):
                await self.grpc.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float) -> None:
        """NOT_SERVING (Envoy's health check stops sending new streams), running streams
        finish within ``grace``, then the cell channels close."""
        for task in (self.watcher, self.resolver):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
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
    initial = file.read() if file else config.cells  # none with a pool: until it is listed
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
    running = EppServer(server, 0, servicer, cells, config, cell_credentials)
    server.server.add_generic_rpc_handlers((ext_proc_handler(servicer),))
    # CacheStats and GetModelInfo, which the Envoy bootstrap routes here (cell_admin).
    generate_pb2_grpc.add_GenerationServicer_to_server(
        CellAdminServicer(lambda: running.cells.pool), server.server)
    try:
        running.port = await server.start(tcp_binder(config.listen, credentials),
                                          config.health_listen)
    except BaseException:
        await cells.close()
        raise
    await server.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    # With a pool, ready once its pods have been listed (EppServer.watch_pool).
    await server.health.set(READINESS, health_pb2.HealthCheckResponse.NOT_SERVING
                            if config.pool else health_pb2.HealthCheckResponse.SERVING)
    await server.set_serving(config.pool is None)
    if config.metrics_port:
        running.metrics = await start_metrics(lambda: running.balancer, config.metrics_port,
                                              registry)
    running.resolver = asyncio.create_task(running.follow_addresses(), name="cell-addresses")
    if file is not None:
        running.watcher = asyncio.create_task(running.follow(file, initial), name="cells-file")
    elif config.pool is not None:
        running.watcher = asyncio.create_task(running.watch_pool(config.pool), name="pool")
    log.info("endpoint picker serving %s on port %d, %s, over %d cells (%d up%s)",
             SERVICE_NAME, running.port, tls_mode(credentials, config.tls.ca),
             len(running.balancer.cells), len(running.balancer.healthy),
             ", TLS" if cell_credentials else "")
    return running


async def serve(config: EppConfig) -> None:
    """Run until SIGTERM or SIGINT, then shut down in order (see EppServer.stop)."""
    cells = (f"the cells of {config.cells_file}" if config.cells_file else
             f"the pods of InferencePool {config.pool.pool}" if config.pool else
             f"{len(config.cells)} cells")
    await serve_until_signalled(
        create_epp(config), f"tandem epp listening on {config.listen} over {cells}",
        config.shutdown_grace_s)
