"""The worker server in-process: health around warm-up and shutdown, health answering while a
step runs, Describe, reflection, the Unix socket's mode, the extra TCP listener, and the
health-only port (health answers there, the Worker API does not)."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.text.byte_tokenizer import BOS_ID
from tandem.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.config import WorkerConfig
from worker_svc.server import SERVICE_NAME, create_server, shutdown
from worker_svc.step import NewRequestData, SamplingParams, StepInput
from worker_svc.step_codec import step_to_proto

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG_PROMPT = 3072  # its prefill (~1 s) outlasts many health round trips (~1 ms)


async def _health(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


async def _list_services(channel: grpc.aio.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]))
    async for resp in call:
        return {s.name for s in resp.list_services_response.service}
    return set()


async def _scenario(tmp_path: Path) -> None:
    config = WorkerConfig(shm_dir=str(tmp_path / "cell"), block_size=16,
                          kv_cache_bytes=32 << 20, worker_listen="127.0.0.1:0")
    worker = await create_server(config)
    try:
        unix, tcp = worker.addresses
        assert unix == f"unix://{config.socket_path}" and tcp.startswith("127.0.0.1:")
        assert stat.S_IMODE(os.stat(config.socket_path).st_mode) == 0o600
        async with grpc.aio.insecure_channel(tcp) as channel:
            if not worker.warmup.done():
                assert await _health(channel) == NOT_SERVING
            stub = worker_pb2_grpc.WorkerStub(channel)
            describe = await stub.Describe(worker_pb2.DescribeRequest(), timeout=60)
            assert await _health(channel) == SERVING
            assert await _health(channel, SERVICE_NAME) == SERVING
            assert (describe.model, describe.device, describe.block_size) == ("tiny", "cpu", 16)
            assert describe.segment_generation == 0  # no segment named yet
            assert describe.num_kv_blocks > 0
            assert {SERVICE_NAME, "grpc.health.v1.Health"} <= await _list_services(channel)

            tokens = [BOS_ID] + [ord("a") + i % 26 for i in range(LONG_PROMPT - 1)]
            req = NewRequestData("long", tokens, len(tokens), [], SamplingParams(),
                                 list(range(LONG_PROMPT // 16)), 0)
            step = stub.Step(step_to_proto(StepInput(
                1, new_requests=[req], num_scheduled_tokens={"long": LONG_PROMPT})), timeout=60)
            answered_during_step = 0
            while not step.done():
                assert await _health(channel) == SERVING
                answered_during_step += not step.done()
            assert answered_during_step >= 1, "health must answer while a step runs"
            assert list((await step).sampled) == ["long"]
    finally:
        await shutdown(worker)
    assert await worker.grpc.health.Check(health_pb2.HealthCheckRequest(), None) == \
        health_pb2.HealthCheckResponse(status=NOT_SERVING)
    assert not config.socket_path.exists()


def test_health_describe_reflection_and_shutdown(tmp_path: Path) -> None:
    asyncio.run(_scenario(tmp_path))


async def _health_port_scenario(tmp_path: Path) -> None:
    config = WorkerConfig(shm_dir=str(tmp_path / "cell"), block_size=16,
                          kv_cache_bytes=32 << 20, health_listen="127.0.0.1:0")
    worker = await create_server(config)
    try:
        assert worker.addresses == [f"unix://{config.socket_path}"], "no Worker API on TCP"
        assert worker.grpc.probes is not None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.grpc.probes.port}") as channel:
            await worker.warmup
            assert await _health(channel) == SERVING
            assert await _health(channel, SERVICE_NAME) == SERVING
            stub = worker_pb2_grpc.WorkerStub(channel)
            for call in (stub.Describe(worker_pb2.DescribeRequest(), timeout=5),
                         stub.Step(step_to_proto(StepInput(1)), timeout=5)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _list_services(channel)  # not even reflection reveals the Worker API
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await shutdown(worker)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.grpc.probes.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _health(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, "closed on shutdown"


def test_health_port_serves_health_and_refuses_the_worker_api(tmp_path: Path) -> None:
    asyncio.run(_health_port_scenario(tmp_path))
