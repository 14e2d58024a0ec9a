"""The endpoint picker (``create_epp``) run inside the test's own process, so a test can
both call it and read its balancer."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Generic, Protocol, TypeVar

from router_svc.epp_server import EppConfig, EppServer, create_epp

T = TypeVar("T")


class _Stoppable(Protocol):
    async def stop(self, grace: float) -> None: ...


S = TypeVar("S", bound=_Stoppable)


class LoopThread(Generic[S]):
    """A server on an event loop in a background thread of this process.

    The server's state belongs to its loop: tests read it through ``read`` (run on that
    loop), never directly from the test's thread.
    """

    def __init__(self, create: Coroutine[Any, Any, S]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: S = self.run(create)
        self.stopped = False

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def read(self, fn: Callable[[], T]) -> T:
        """``fn()`` evaluated on the server's loop."""
        async def call() -> T:
            return fn()
        return self.run(call())

    def stop(self) -> None:
        """Stop the server (grace 0); the loop keeps running until ``close``."""
        if not self.stopped:
            self.stopped = True
            self.run(self.server.stop(0))

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@contextlib.contextmanager
def running_epp(config: EppConfig) -> Iterator[LoopThread[EppServer]]:
    """The endpoint picker for the ``with`` block (``.stop()`` stops it early)."""
    running = LoopThread(create_epp(config))
    try:
        yield running
    finally:
        running.close()
