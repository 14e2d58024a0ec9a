"""uvicorn serving the HTTP app in the caller's asyncio loop, next to its gRPC server.

``HttpServer.start`` binds the socket itself (so a bad address fails the start with an
OSError, and port 0 gives a free port), then runs ``uvicorn.Server`` as a task of the
running loop; ``stop`` lets in-flight responses finish for up to ``grace`` seconds, as
the gRPC server's stop does. TLS uses the gRPC port's files: certificate and key make
it HTTPS, a client CA makes clients present a certificate it signed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from tandem.openai_api.app import create_app
from tandem.openai_api.backend import Backend
from tandem.openai_api.remote_images import RemoteImageFetcher, RemoteImageLimits
from tandem.tls import TlsConfigError, TlsFiles


@dataclass(frozen=True)
class HttpConfig:
    """``--http-*`` settings (docs/configuration.md); ``listen`` empty = no HTTP port."""

    listen: str = ""
    allow_remote_images: bool = False  # fetch image_url http(s) URLs (guarded, limited)
    remote_images: RemoteImageLimits = field(default_factory=RemoteImageLimits)


class _Server(uvicorn.Server):
    """NOTE: uvicorn's ``serve`` replaces the process's SIGINT/SIGTERM handlers with its
    own; the scheduler owns its shutdown order, so signals stay theirs and
    this server stops when told to."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def split_listen(listen: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--http-listen {listen!r}: expected host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


def ssl_settings(tls: TlsFiles) -> dict[str, object]:
    """uvicorn's TLS settings from the gRPC port's files (the same rules: cert + key, an
    optional client CA that makes client certificates mandatory)."""
    if not tls.enabled:
        return {}
    if not (tls.cert and tls.key):
        raise TlsConfigError("TLS needs both --tls-cert and --tls-key (--tls-client-ca only "
                             "adds client verification)")
    settings: dict[str, object] = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
    if tls.ca:
        settings.update(ssl_ca_certs=tls.ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return settings


@dataclass
class HttpServer:
    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int
    fetcher: RemoteImageFetcher | None = None

    @classmethod
    async def start(cls, backend: Backend, config: HttpConfig, tls: TlsFiles,
                    max_body_bytes: int, metrics: CollectorRegistry | None = None,
                    ) -> HttpServer:
        """Serve the app over ``backend`` on ``config.listen``, refusing request bodies
        over ``max_body_bytes`` (:func:`tandem.request_limits.max_http_body_bytes`), with
        ``GET /metrics`` when ``metrics`` is set."""
        fetcher = (RemoteImageFetcher(config.remote_images) if config.allow_remote_images
                   else None)
        try:
            return await cls._start(create_app(backend, max_body_bytes, fetcher, metrics),
                                    config.listen, tls, fetcher)
        except BaseException:
            if fetcher is not None:
                await fetcher.close()
            raise

    @classmethod
    async def _start(cls, app: FastAPI, listen: str, tls: TlsFiles,
                     fetcher: RemoteImageFetcher | None) -> HttpServer:
        host, port = split_listen(listen)
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                                **ssl_settings(tls))  # type: ignore[arg-type]
        try:
            config.load()  # reads the TLS files: a bad one fails here, by name
        except (OSError, ssl.SSLError) as exc:
            raise TlsConfigError(f"the HTTP port's TLS files: {exc}") from exc
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        server = _Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]), name="http-server")
        while not server.started:
            if task.done():  # it failed to start: raise why
                sock.close()
                await task
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return cls(server, task, sock.getsockname()[1], fetcher)

    async def stop(self, grace: float) -> None:
        """Refuse new connections; let open responses finish for up to ``grace`` s, then
        cancel them (which aborts their requests)."""
        # uvicorn hands this to asyncio.wait_for, so a float works; at 0 it would time out
        # (and log so) even with nothing left to wait for.
        self.server.config.timeout_graceful_shutdown = max(grace, 0.05)  # type: ignore[assignment]
        self.server.should_exit = True
        # uvicorn closes an idle keep-alive connection gracefully, which over TLS waits for
        # the client's close_notify, up to asyncio's SSL shutdown timeout (30 s): a client
        # that keeps its connection in a pool (openai's, httpx's) held the stop for the
        # whole grace, and a supervisor that stops at the grace killed the process. Once no
        # response is in flight (uvicorn's task set empty), what is left is idle: aborted.
        state = self.server.server_state
        while not self.task.done():
            if not state.tasks:
                for connection in list(state.connections):
                    connection.transport.abort()  # type: ignore[attr-defined]
            await asyncio.wait({self.task}, timeout=0.05)
        await self.task
        if self.fetcher is not None:
            await self.fetcher.close()
