"""The router (``create_router``) run inside the test's own process, so a test can both call
it (gRPC, and HTTP when configured) and read its balancer."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import grpc

from router_svc.server import RouterConfig, RouterServer, create_router
from tandem.v1 import generate_pb2_grpc

T = TypeVar("T")


class RouterThread:
    """The router on an event loop in a background thread of this process.

    The router's state belongs to its loop: tests read it through ``read`` (run on that loop),
    never directly from the test's thread.
    """

    def __init__(self, config: RouterConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: RouterServer = self.run(create_router(config))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        # The OpenAI-compatible HTTP API's base URL ("" when ``config.http`` has no listen).
        http = self.server.http
        self.url = f"http://127.0.0.1:{http.port}" if http is not None else ""

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def read(self, fn: Callable[[], T]) -> T:
        """``fn()`` evaluated on the router's loop."""
        async def call() -> T:
            return fn()
        return self.run(call())

    def close(self) -> None:
        self.channel.close()
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@contextlib.contextmanager
def running_router(config: RouterConfig) -> Iterator[RouterThread]:
    """A ``RouterThread`` for the ``with`` block, stopped (grace 0) afterwards."""
    running = RouterThread(config)
    try:
        yield running
    finally:
        running.close()
