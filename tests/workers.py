"""Start a real worker process (spawned) and wait until its health says SERVING."""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from worker_svc.config import WorkerConfig
from worker_svc.server import serve


@contextlib.contextmanager
def running_worker(config: WorkerConfig) -> Iterator[tuple[BaseProcess, grpc.Channel]]:
    """The worker process and a channel to its Unix socket; stopped afterwards."""
    proc = multiprocessing.get_context("spawn").Process(target=serve, args=(config,))
    proc.start()
    try:
        with grpc.insecure_channel(f"unix://{config.socket_path}") as channel:
            wait_serving(channel)
            yield proc, channel
    finally:
        if proc.is_alive():
            proc.terminate()
        proc.join(20)
        if proc.is_alive():
            proc.kill()


def wait_serving(channel: grpc.Channel, timeout: float = 60.0) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp = stub.Check(health_pb2.HealthCheckRequest(), wait_for_ready=True, timeout=timeout)
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            return
        time.sleep(0.05)
    raise TimeoutError("worker did not become SERVING")
