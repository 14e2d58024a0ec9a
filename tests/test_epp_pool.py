"""`tandem epp --pool`: the picker's cells follow an InferencePool and the pods it selects
(router_svc/pool_watch.py), watched through the API emulator's HTTP API as a real API server
would serve them. Pods are written by the test as the kubelet would: created, then Ready
through their status subresource; their IPs are loopback addresses of the test's choosing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kube_emulator.fixtures import Cluster, emulated_cluster

from router_svc.epp_server import READINESS, EppConfig, EppServer
from router_svc.pool_watch import PoolSource
from tandem_testing.cells import free_port
from tandem_testing.router import LoopThread, running_epp


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with emulated_cluster(tmp_path_factory.mktemp("pool")) as cluster:
        yield cluster


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def cells(epp: LoopThread[EppServer]) -> set[str]:
    """The picker's cells as `host:grpc/http`."""
    return epp.read(lambda: {f"{c.name}/{c.http_port}"
                             for c in epp.server.picker.cells.values()})


def readiness(epp: LoopThread[EppServer]) -> Any:
    with grpc.insecure_channel(f"127.0.0.1:{epp.server.port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=READINESS), timeout=5).status


def test_the_cells_follow_the_pools_ready_pods(cluster: Cluster) -> None:
    grpc_port, http_port = free_port(), free_port()
    source = PoolSource("demo-grpc", "demo-http", cluster.namespace, str(cluster.kubeconfig))
    with running_epp(EppConfig(listen="127.0.0.1:0", health_interval=0.1,
                               pool=source)) as epp:
        # No pool yet: no cells, and not ready until the pods have been listed.
        time.sleep(0.5)
        assert readiness(epp) == health_pb2.HealthCheckResponse.NOT_SERVING
        cluster.write.pool("demo-grpc", grpc_port, {"app": "a"})
        cluster.write.pool("demo-http", http_port, {"app": "a"})
        wait_for(lambda: readiness(epp) == health_pb2.HealthCheckResponse.SERVING)
        assert cells(epp) == set()
        # A pod is a cell once Ready, at the ports of the two pools.
        cluster.write.pod("a-0", {"app": "a"}, "127.0.0.2", ready=False)
        cluster.write.pod("a-1", {"app": "a"}, "127.0.0.3")
        cluster.write.pod("b-0", {"app": "b"}, "127.0.0.4")
        wait_for(lambda: cells(epp) == {f"127.0.0.3:{grpc_port}/{http_port}"})
        cluster.write.pod("a-0", {"app": "a"}, "127.0.0.2")
        wait_for(lambda: len(cells(epp)) == 2)
        # A dropped watch is resumed: what changed meanwhile still arrives.
        cluster.emulator.drop_watches()
        cluster.write.delete(f"{cluster.write.pods}/a-1")
        wait_for(lambda: cells(epp) == {f"127.0.0.2:{grpc_port}/{http_port}"})
        # A new selector (and port): the pods of the new one; two pods at one address
        # (host-network pods, one replacing the other) are one cell.
        cluster.write.pod("b-1", {"app": "b"}, "127.0.0.4")
        cluster.write.pool("demo-grpc", grpc_port + 1, {"app": "b"})
        wait_for(lambda: cells(epp) == {f"127.0.0.4:{grpc_port + 1}/{http_port}"})
        # A deleted pool keeps the cells the picker had.
        cluster.write.delete(f"{cluster.write.pools}/demo-grpc")
        cluster.write.pod("b-2", {"app": "b"}, "127.0.0.5")
        time.sleep(0.5)
        assert cells(epp) == {f"127.0.0.4:{grpc_port + 1}/{http_port}"}
        assert readiness(epp) == health_pb2.HealthCheckResponse.SERVING


def test_an_unreachable_api_server_is_logged_and_the_picker_stays_unready(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with emulated_cluster(tmp_path) as cluster:  # a kubeconfig for a server that is gone
        source = PoolSource("demo-grpc", "", cluster.namespace, str(cluster.kubeconfig))
    config = EppConfig(listen="127.0.0.1:0", pool=source)
    with caplog.at_level(logging.WARNING, "router_svc.pool_watch"), running_epp(config) as epp:
        wait_for(lambda: "the API server is unreachable" in caplog.text)
        assert readiness(epp) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert cells(epp) == set()
