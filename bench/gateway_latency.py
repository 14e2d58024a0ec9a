"""What Envoy plus the endpoint picker add to a request's latency, on loopback.

One local cell (``tandem serve``, the ``tiny`` model) and ``tandem gateway`` in front of it.
Calls go alternately straight to the cell and through the gateway, so drifting load on a
shared machine hits both alike; the script prints each path's p50/p99 and the pairwise
difference, the latency the gateway adds. By default the calls are ``GetModelInfo``: it
passes Envoy and the picker exactly as Generate does (headers, buffered body, pick,
streamed body, echoed response) but costs the cell next to nothing, so the model's step
time, which varies by tens of milliseconds on a busy machine, does not drown the
difference; ``--generate`` times one-token Generate calls instead. Run::

    python bench/gateway_latency.py                  # 200 calls per path
    python bench/gateway_latency.py --requests 1000 --generate
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from tandem.v1 import generate_pb2, generate_pb2_grpc
from tandem_testing.cells import free_port, request, running_cell, stop_process


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def one_call(stub: generate_pb2_grpc.GenerationStub, generate: bool) -> float:
    start = time.perf_counter()
    if generate:
        for _ in stub.Generate(request("Say hi.", max_tokens=1), timeout=30):
            pass
    else:
        stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="calls per path")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--generate", action="store_true",
                        help="time one-token Generate calls instead of GetModelInfo")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, \
            running_cell(Path(tmp) / "cell", debug_invariants=False) as cell:
        listen = f"127.0.0.1:{free_port()}"
        log = Path(tmp) / "gateway.log"
        with open(log, "wb") as out:
            gateway = subprocess.Popen(
                [sys.executable, "-m", "tandem_cli.cli", "gateway", "--cells", cell.target,
                 "--listen", listen, "--admin-port", str(free_port()), "--log-level", "WARNING"],
                stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while b"listening" not in log.read_bytes():
                if gateway.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"gateway did not start:\n{log.read_text()}")
                time.sleep(0.1)
            with grpc.insecure_channel(listen) as channel:
                paths = {"direct": cell.stub, "gateway": generate_pb2_grpc.GenerationStub(channel)}
                times: dict[str, list[float]] = {name: [] for name in paths}
                for i in range(args.warmup + args.requests):
                    for name, stub in paths.items():
                        elapsed = one_call(stub, args.generate)
                        if i >= args.warmup:
                            times[name].append(elapsed)
        finally:
            stop_process(gateway, 20)
    what = "Generate calls (1 output token)" if args.generate else "GetModelInfo calls"
    print(f"{args.requests} {what} per path, ms:")
    stats = {name: (percentile(t, 50) * 1e3, percentile(t, 99) * 1e3)
             for name, t in times.items()}
    for name, (p50, p99) in stats.items():
        print(f"  {name:8s} p50 {p50:7.2f}  p99 {p99:7.2f}")
    added = [g - d for g, d in zip(times["gateway"], times["direct"], strict=True)]
    print(f"  added    p50 {stats['gateway'][0] - stats['direct'][0]:7.2f}  "
          f"p99 {stats['gateway'][1] - stats['direct'][1]:7.2f}  "
          f"(pairwise: p50 {percentile(added, 50) * 1e3:.2f}, "
          f"p99 {percentile(added, 99) * 1e3:.2f})")


if __name__ == "__main__":
    main()
