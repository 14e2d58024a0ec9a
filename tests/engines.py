"""An in-process scheduler engine over real worker processes, for fault tests that need to
see (and time) what the engine does: the engine, its segment and its worker pool run in the
test's event loop; the workers are processes from ``workers.running_worker``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.request import Request
from scheduler_svc.worker_client import WorkerPool
from tandem.processor_cache import ShmProcessorCache
from tandem.v1 import generate_pb2


@asynccontextmanager
async def running_engine(shm: Path, address: str | None = None, workers: int = 1,
                         **settings: object) -> AsyncIterator[Engine]:
    """An engine over the ``workers`` workers of ``shm`` (or whatever serves ``address``),
    with a fresh 1 MiB segment in ``shm`` (a new generation: the workers drop their old
    requests)."""
    addresses = ((address,) if address is not None
                 else tuple(f"unix://{shm}/worker-{rank}.sock" for rank in range(workers)))
    config = SchedulerConfig(shm_dir=str(shm), worker_addresses=addresses,
                             **settings)  # type: ignore[arg-type]
    cache = ShmProcessorCache(shm, 1 << 20, n_readers=len(addresses),
                              max_object_size=1 << 20)
    pool = WorkerPool(list(config.worker_addresses))
    engine = Engine(config, cache, pool)
    try:
        await engine.start()
        yield engine
    finally:
        await engine.stop()
        await pool.close()
        cache.close()


async def generate(engine: Engine, msg: generate_pb2.GenerateRequest,
                   on_first: Callable[[Request], None] = lambda _: None) -> list[int]:
    """The request's token ids; ``on_first`` sees the request with its first output."""
    tokens: list[int] = []
    async for request, out in engine.generate(msg):
        if not tokens:
            on_first(request)
        tokens += out.token_ids
    return tokens


async def until(predicate: Callable[[], bool], timeout: float = 30.0,
                state: Callable[[], object] | None = None) -> None:
    """Poll ``predicate``; on timeout the error shows ``state()`` (what was not reached)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            shown = f": {state()}" if state is not None else ""
            raise AssertionError(f"condition not reached in time{shown}")
        await asyncio.sleep(0.02)


async def idle(engine: Engine) -> None:
    """Until the engine has nothing left to send (the last releases included)."""
    await until(lambda: engine.scheduler is not None and not engine.scheduler.has_work
                and not engine.steps_out)
    await asyncio.sleep(0.2)
