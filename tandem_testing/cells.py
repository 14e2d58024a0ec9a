"""Start real local cells (``tandem serve`` in a subprocess) and talk to them in tests."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from tandem.v1 import generate_pb2, generate_pb2_grpc

SERVICE = "tandem.v1.Generation"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port P with P + 1 also free: ``tandem serve --metrics-port P`` serves the
    scheduler's metrics on P and worker 0's on P + 1."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


@dataclass
class Cell:
    target: str
    shm_dir: Path
    proc: subprocess.Popen
    channel: grpc.Channel

    @property
    def stub(self) -> generate_pb2_grpc.GenerationStub:
        return generate_pb2_grpc.GenerationStub(self.channel)

    def generate(self, prompt: str, images: list[bytes] = (), max_tokens: int = 8,
                 **sampling: object) -> tuple[list[int], str, generate_pb2.GenerateResponse]:
        """Run one request; returns (token ids, text, last message)."""
        return self.stream(request(prompt, images, max_tokens, **sampling))

    def stream(self, msg: generate_pb2.GenerateRequest,
               ) -> tuple[list[int], str, generate_pb2.GenerateResponse]:
        """Run ``msg`` to its end; returns (token ids, text, last message)."""
        return stream(self.stub, msg)

    def stats(self) -> generate_pb2.CacheStatsResponse:
        return self.stub.CacheStats(generate_pb2.CacheStatsRequest(), timeout=10)

    def health(self, service: str = SERVICE) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def worker_pids(self) -> list[int]:
        """Pids of the worker processes ``tandem serve`` spawned (not its resource tracker)."""
        return spawned_children(self.proc.pid)


def children(pid: int) -> list[int]:
    """The live children of ``pid`` (of any of its threads), in pid order; none once it is
    gone."""
    pids: list[int] = []
    with contextlib.suppress(FileNotFoundError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):
                pids += [int(c) for c in (task / "children").read_text().split()]
    return sorted(set(pids))


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (an engine's workers and their helpers)."""
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children(out[-1])
    return out


def spawned_children(pid: int) -> list[int]:
    """Children of ``pid`` started by multiprocessing's spawn (workers), in pid order."""
    out = []
    for child in children(pid):
        with contextlib.suppress(FileNotFoundError):
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(child)
    return out


def stream(stub: generate_pb2_grpc.GenerationStub, msg: generate_pb2.GenerateRequest,
           ) -> tuple[list[int], str, generate_pb2.GenerateResponse]:
    """Run ``msg`` to its end on ``stub``; returns (token ids, text, last message)."""
    ids: list[int] = []
    text = ""
    last = None
    for last in stub.Generate(msg, timeout=120):
        ids.extend(last.token_ids)
        text += last.text
    assert last is not None and last.finish_reason != 0
    return ids, text, last


def request(prompt: str, images: list[bytes] = (), max_tokens: int = 8, cache_salt: str = "",
            **sampling: object) -> generate_pb2.GenerateRequest:
    msg = generate_pb2.GenerateRequest(prompt=prompt, cache_salt=cache_salt)
    for data in images:
        msg.images.add(encoded=data)
    msg.sampling.max_tokens = max_tokens
    for key, value in sampling.items():
        setattr(msg.sampling, key, value)
    return msg


def png(seed: int, width: int = 112, height: int = 84) -> bytes:
    """A deterministic random PNG."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@contextlib.contextmanager
def running_cell(tmp: Path, *flags: str, timeout: float = 90.0,
                 debug_invariants: bool = True) -> Iterator[Cell]:
    """``tandem serve`` with its segment under ``tmp``; stopped (SIGTERM) afterwards.

    Tests check the bookkeeping after every step (``TANDEM_DEBUG_INVARIANTS=1``);
    benchmarks pass ``debug_invariants=False`` to time what production runs.
    """
    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    shm_dir = tmp / "shm"
    cmd = [sys.executable, "-m", "tandem_cli.cli", "serve", "--listen", f"127.0.0.1:{port}",
           "--shm-dir", str(shm_dir), "--kv-cache-size", "16Mi", "--log-level", "WARNING",
           *flags]
    log = open(tmp / "cell.log", "wb")  # noqa: SIM115 - closed below
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               TANDEM_DEBUG_INVARIANTS="1" if debug_invariants else "0")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    cell = Cell(f"127.0.0.1:{port}", shm_dir, proc, channel)
    try:
        _wait_serving(cell, timeout, tmp / "cell.log")
        yield cell
    finally:
        channel.close()
        stop_process(proc, 30)
        log.close()


@contextlib.contextmanager
def running_cells(managers: Sequence[contextlib.AbstractContextManager[Cell]],
                  ) -> Iterator[list[Cell]]:
    """Cells (``running_cell`` managers) started and stopped in parallel, as each takes
    seconds either way; a start-up failure is raised once the cells that did start are
    stopped again."""
    with ThreadPoolExecutor(len(managers)) as pool:
        futures = [pool.submit(m.__enter__) for m in managers]
        entered = [m for m, f in zip(managers, futures, strict=True) if f.exception() is None]
        try:
            yield [f.result() for f in futures]  # raises the first start-up failure
        finally:
            list(pool.map(lambda m: m.__exit__(None, None, None), entered))


def kill_cell(cell: Cell) -> None:
    """SIGKILL the cell's scheduler and its worker processes (a crash, not a shutdown)."""
    pids = descendants(cell.proc.pid)
    cell.proc.kill()
    cell.proc.wait()
    for pid in pids[1:]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL if it is not done within ``timeout``."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_serving(cell: Cell, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cell.proc.poll() is not None:
            raise RuntimeError(f"cell exited early:\n{log.read_text()[-4000:]}")
        try:
            if cell.health() == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"cell not serving after {timeout}s:\n{log.read_text()[-4000:]}")
