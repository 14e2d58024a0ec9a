"""What Envoy plus the endpoint picker add to a request's latency, on loopback.

One local cell (``tandem serve``, the ``tiny`` model), the picker (``create_epp``, as
``tandem gateway`` runs it) and a fail-open Envoy with the gateway's bootstrap. Calls go
alternately straight to the cell and through Envoy, so drifting load on a shared machine
hits both alike. Then the picker stops and the same is done again: fail-open Envoy now
forwards without asking anyone, which gives Envoy's own share. By default the calls are
gRPC health checks of the cell's service: one passes Envoy and the picker exactly as
Generate does (headers, buffered body, pick, streamed body, the response's trailers) but
costs the cell next to nothing (GetModelInfo would not do: Envoy sends it to the picker itself),
so the model's step time, which varies by tens of milliseconds on a busy machine, does not
drown the difference; ``--generate`` times one-token Generate calls instead. Run::

    python bench/gateway_latency.py                  # 200 calls per path and phase
    python bench/gateway_latency.py --requests 1000 --generate
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router_svc.epp import CellEndpoint
from router_svc.epp_server import EppConfig
from tandem.v1 import generate_pb2, generate_pb2_grpc
from tandem_cli.gateway import (
    GatewayConfig,
    gateway_bootstrap,
    start_envoy,
    stop_envoy,
    wait_envoy_ready,
    write_cells,
)
from tandem_testing.cells import free_port, request, running_cell
from tandem_testing.router import running_epp

SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def compare(direct: Callable[[], object], gateway: Callable[[], object], label: str,
            requests: int, warmup: int) -> None:
    """``requests`` alternating calls per path after ``warmup``; prints the percentiles."""
    pairs = [(timed(direct), timed(gateway)) for _ in range(warmup + requests)][warmup:]
    d, g = [p[0] for p in pairs], [p[1] for p in pairs]
    added = [b - a for a, b in pairs]
    print(f"  direct {percentile(d, 50):6.2f} / {percentile(d, 99):6.2f}   {label} "
          f"{percentile(g, 50):6.2f} / {percentile(g, 99):6.2f}   added (pairwise) "
          f"{percentile(added, 50):6.2f} / {percentile(added, 99):6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="calls per path and phase")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--generate", action="store_true",
                        help="time one-token Generate calls instead of health checks")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, \
            running_cell(Path(tmp) / "cell", debug_invariants=False) as cell:
        host, port = cell.target.rsplit(":", 1)
        config = EppConfig(cells=(CellEndpoint(host, int(port), 1, host),),
                           listen="127.0.0.1:0")
        with running_epp(config) as epp:
            gateway = GatewayConfig(config, f"127.0.0.1:{free_port()}", free_port(),
                                    fail_open=True)
            write_cells(Path(tmp) / "cells", config.cells)
            proc = start_envoy(gateway_bootstrap(gateway, epp.server.port, Path(tmp) / "cells"),
                               Path(tmp))
            try:
                wait_envoy_ready(proc, gateway.admin_port, Path(tmp))
                with grpc.insecure_channel(gateway.listen) as channel:
                    if args.generate:
                        stubs = [cell.stub, generate_pb2_grpc.GenerationStub(channel)]
                        msg = request("Say hi.", max_tokens=1)
                        direct, through = (lambda s=s: list(s.Generate(msg, timeout=30))
                                           for s in stubs)
                    else:
                        checks = [health_pb2_grpc.HealthStub(c) for c in (cell.channel, channel)]
                        check = health_pb2.HealthCheckRequest(service=SERVICE)
                        direct, through = (lambda s=s: s.Check(check, timeout=30) for s in checks)
                    what = "one-token Generate" if args.generate else "health check"
                    print(f"{args.requests} {what} calls per path, p50 / p99 in ms:")
                    compare(direct, through, "envoy+epp", args.requests, args.warmup)
                    epp.stop()
                    deadline = time.monotonic() + 10  # Envoy's health check sees it gone
                    while time.monotonic() < deadline:
                        try:
                            through()
                            break
                        except grpc.RpcError:
                            time.sleep(0.2)
                    compare(direct, through, "envoy   ", args.requests, args.warmup)
            finally:
                stop_envoy(proc)


if __name__ == "__main__":
    main()
