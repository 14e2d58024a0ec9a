"""The gRPC server set-up every Tandem process shares: scheduler, worker, endpoint picker.

``GrpcServer.create`` gives a ``grpc.aio`` server with the one error-mapping interceptor
(``tandem.errors``), the request-span interceptor when tracing is on, finite message limits,
the standard ``grpc.health.v1`` service (NOT_SERVING for the served service until the
process says otherwise) and reflection. ``start`` binds through the caller's function (TCP
with or without TLS, or the worker's Unix socket) and opens the health-only port;
``stop`` is the graceful half of shutdown.

The health-only port: ``grpc.health.v1`` alone, in plaintext, on its own ``host:port``.
Kubelet gRPC probes speak no TLS and carry no client certificate, and a worker's Step API
has no authentication at all, so probes get a port of their own where nothing but health
is served (``--health-listen`` / ``TANDEM_HEALTH_LISTEN``: scheduler, worker, endpoint picker).
It shares the servicer of the main server, so both always report the same statuses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem import tracing
from tandem.errors import ErrorMappingInterceptor

T = TypeVar("T")
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class HealthPort:
    """A started health-only server and the port it bound."""

    server: grpc.aio.Server
    port: int

    @classmethod
    async def start(cls, servicer: health.aio.HealthServicer,
                    listen: str) -> HealthPort | None:
        """Serve ``servicer`` alone on ``listen`` (``""`` = no port; ``host:0`` picks one)."""
        if not listen:
            return None
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port(listen)
        await server.start()
        return cls(server, port)

    async def stop(self) -> None:
        """Stop at once: probes are retried by the kubelet, never drained."""
        await self.server.stop(0)


@dataclass
class GrpcServer:
    """One process's server: ``service`` (its full name) plus health and reflection."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    service: str
    probes: HealthPort | None = None

    @classmethod
    def create(cls, service: str, options: list[tuple[str, int]],
               trace_calls: bool = True) -> GrpcServer:
        """The server, not yet bound; ``options`` must set the message-size limits.
        ``trace_calls``: one SERVER span per call when tracing is on (public APIs; the
        worker's steps have spans of their own, linked to the requests).

        Register the service's servicer on ``.server`` before ``start``.
        """
        names = {name for name, _ in options}
        if "grpc.max_receive_message_length" not in names:
            raise ValueError("a Tandem server needs a finite grpc.max_receive_message_length")
        interceptors: list[grpc.aio.ServerInterceptor] = [ErrorMappingInterceptor()]
        if trace_calls and tracing.enabled():  # outermost: the span sees the mapped status
            interceptors.insert(0, tracing.ServerSpanInterceptor([service]))
        server = grpc.aio.server(interceptors=interceptors, options=options)
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        reflection.enable_server_reflection(
            (service, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        return cls(server, servicer, service)

    async def start(self, bind: Callable[[grpc.aio.Server], T], health_listen: str = "",
                    overall_serving: bool = True) -> T:
        """Health first (the service NOT_SERVING; the server as a whole SERVING unless
        ``overall_serving`` is False), then ``bind(server)``, start, and the health-only
        port. Returns what ``bind`` returned (the bound port or addresses)."""
        await self.health.set("", _SERVING if overall_serving else _NOT_SERVING)
        await self.health.set(self.service, _NOT_SERVING)
        bound = bind(self.server)
        await self.server.start()
        try:
            self.probes = await HealthPort.start(self.health, health_listen)
        except BaseException:
            await self.server.stop(0)
            raise
        return bound

    async def set_serving(self, serving: bool, overall: bool = False) -> None:
        """The served service's status (and the server's as a whole if ``overall``)."""
        status = _SERVING if serving else _NOT_SERVING
        for name in ("", self.service) if overall else (self.service,):
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        """Health NOT_SERVING, refuse new calls and let in-flight ones finish (up to
        ``grace``; the rest are cancelled), then close the health-only port."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.probes is not None:
            await self.probes.stop()


def tcp_binder(listen: str,
               credentials: grpc.ServerCredentials | None) -> Callable[[grpc.aio.Server], int]:
    """Bind ``listen`` with TLS when ``credentials`` are given; the bound port."""
    def bind(server: grpc.aio.Server) -> int:
        if credentials is not None:
            return server.add_secure_port(listen, credentials)
        return server.add_insecure_port(listen)
    return bind


def tls_mode(credentials: grpc.ServerCredentials | None, client_ca: str) -> str:
    """How the public port is served, for the start-up log line."""
    return "mutual TLS" if client_ca else "TLS" if credentials else "plaintext"
