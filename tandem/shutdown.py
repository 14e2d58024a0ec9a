"""How long a stopping Tandem process lets running work finish (``--shutdown-grace``).

The one definition of the default for the scheduler, the workers, the endpoint picker,
``tandem serve`` and the operator's pods (docs/reliability.md, "Shutdown"). On SIGTERM a
scheduler stops admitting at once and lets running streams finish for up to the grace; a
worker keeps running the steps of a scheduler that still streams to it for up to its grace
(that scheduler may be stopping too: Kubernetes stops a cell's pods together).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable
from typing import Protocol

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 30.0
# What a process needs after its grace to stop in order: the engine's last step, closing
# channels, unlinking the segment, flushing traces. Pods get their grace plus this before
# the kubelet kills them; a cell's workers wait this much longer than its scheduler.
STOP_MARGIN_S = 10.0



class Stoppable(Protocol):
    async def stop(self, grace: float) -> None: ...


async def serve_until_signalled(create: Awaitable[Stoppable], banner: str,
                                grace: float) -> None:
    """Start a server (``create``), print ``banner`` and the pid, run until SIGTERM or
    SIGINT, then stop it with ``grace`` (its ``stop`` shuts down in order)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = await create
    print(f"{banner} (pid {os.getpid()})", flush=True)
    await stop.wait()
    log.info("shutting down (grace %.1f s)", grace)
    await running.stop(grace)
