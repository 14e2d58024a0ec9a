"""The health-only port: ``grpc.health.v1`` alone, in plaintext, on its own ``host:port``.

Kubelet gRPC probes speak no TLS and carry no client certificate, and a worker's Step API
has no authentication at all, so probes get a port of their own where nothing but health
is served (``--health-listen`` / ``TANDEM_HEALTH_LISTEN``: scheduler, worker and router).
It shares the servicer of the main server, so both always report the same statuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2_grpc


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
