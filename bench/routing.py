"""Cache-affine routing vs round-robin over three local cells, on a Zipf image workload.

Every arm sends the same request sequence (images drawn from a Zipf distribution, so a few
images are hot and many are rare) to the same three ``tandem serve`` cells:

* ``round-robin``: the client sends request i straight to cell i mod 3;
* ``affinity``: straight to the cell the picker's balancer picks (the routing policy
  alone, no extra hop);
* ``envoy-rr``: through an Envoy with the gateway's bootstrap whose picker never answers,
  fail-open: its fallback cluster, round robin (the gateway's hop without affinity);
* ``gateway``: through ``tandem gateway`` (a real Envoy asking the endpoint picker: the
  policy plus Envoy's and the picker's hop; the picker's added latency alone is
  ``bench/gateway_latency.py``'s).

Each arm uses its own ``cache_salt``, so no arm reuses another's cached images or
prefixes. Requests run one at a time and the arms take turns request by request (rotating
who goes first), so drifting load on a shared machine hits every arm alike; an arm's
tokens/s is its tokens over the time spent in its own requests. The script prints hit
rates, tokens/s and TTFT p50/p99 per arm, the ratios to round-robin, the gateway's to
Envoy's round robin (what affinity gains through the same hop) and to ``affinity`` (issue
26's target: a hit rate >= 0.95x the policy's own; the TTFT difference is the hop's
cost), and the ceiling: the hit rate of one cell with an unbounded cache (every repeat of
an image hits). Run::

    python bench/routing.py --quick      # ~2 minutes on 2 busy cores
    python bench/routing.py --requests 300 --images 40
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router_svc.balancer import Balancer
from router_svc.epp import CellEndpoint
from router_svc.epp_server import EppConfig
from router_svc.routing_key import routing_key
from tandem.cell_stats import CELL_HEADER  # the serving cell, where the path names it
from tandem.v1 import generate_pb2, generate_pb2_grpc
from tandem_cli.gateway import (
    GatewayConfig,
    gateway_bootstrap,
    start_envoy,
    stop_envoy,
    wait_envoy_ready,
    write_cells,
)
from tandem_testing.cells import Cell, free_port, png, request, running_cell

PROMPT = "Describe <image> in a few words."
BLOCK_SIZE = 16
# (request index, request) -> (the cell that served it, its usage, its TTFT in seconds)
Send = Callable[[int, generate_pb2.GenerateRequest], tuple[str, generate_pb2.Usage, float]]


@dataclass
class Arm:
    """One routing policy and what its requests cost and got."""

    name: str
    send: Send
    seconds: float = 0.0
    usage: Counter[str] = field(default_factory=Counter)
    per_cell: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    ttfts: list[float] = field(default_factory=list)

    def run(self, i: int, msg: generate_pb2.GenerateRequest) -> None:
        start = time.perf_counter()
        try:
            cell, usage, ttft = self.send(i, msg)
        except grpc.RpcError as exc:
            self.errors[exc.code().name] += 1
            return
        finally:
            self.seconds += time.perf_counter() - start
        self.ttfts.append(ttft)
        self.per_cell[cell] += 1
        for f in usage.DESCRIPTOR.fields:
            if not f.is_repeated and f.message_type is None:  # the counts
                self.usage[f.name] += getattr(usage, f.name)

    def rate(self, part: str, whole: str) -> float:
        return self.usage[part] / max(self.usage[whole], 1)

    def per_s(self, what: str) -> float:
        return self.usage[what] / self.seconds

    def ttft_ms(self, q: int) -> float:
        return float(np.percentile(self.ttfts, q)) * 1e3 if self.ttfts else float("nan")


def zipf_sequence(n: int, distinct: int, s: float, seed: int) -> list[int]:
    """``n`` image ids in ``[0, distinct)``, P(rank k) proportional to 1 / k**s."""
    weights = 1.0 / np.arange(1, distinct + 1) ** s
    rng = np.random.default_rng(seed)
    return rng.choice(distinct, size=n, p=weights / weights.sum()).tolist()


def call(stub: generate_pb2_grpc.GenerationStub, msg: generate_pb2.GenerateRequest,
         cell: str) -> tuple[str, generate_pb2.Usage, float]:
    start = time.perf_counter()
    stream = stub.Generate(msg, timeout=300)
    ttft = 0.0
    for last in stream:
        if last.token_ids and not ttft:
            ttft = time.perf_counter() - start
    return dict(stream.initial_metadata()).get(CELL_HEADER, cell), last.usage, ttft


def make_arms(cells: list[Cell], envoy_rr: generate_pb2_grpc.GenerationStub,
              gateway: generate_pb2_grpc.GenerationStub) -> list[Arm]:
    stubs = {c.target: c.stub for c in cells}
    targets = [c.target for c in cells]
    balancer = Balancer(targets)
    for t in targets:
        balancer.set_healthy(t, True)

    def affinity(_: int, msg: generate_pb2.GenerateRequest,
                 ) -> tuple[str, generate_pb2.Usage, float]:
        decision = balancer.route(routing_key(msg, BLOCK_SIZE))
        assert decision is not None
        try:
            return call(stubs[decision.cell], msg, decision.cell)
        finally:
            balancer.release(decision.cell)

    return [Arm("round-robin", lambda i, m: call(stubs[targets[i % 3]], m, targets[i % 3])),
            Arm("affinity", affinity),
            Arm("envoy-rr", lambda _, m: call(envoy_rr, m, "?")),
            Arm("gateway", lambda _, m: call(gateway, m, "?"))]


def run(arms: list[Arm], images: list[bytes], seq: list[int], max_tokens: int) -> None:
    """Request i of every arm, the arms in rotated order, then request i + 1."""
    for i, image in enumerate(seq):
        for k in range(len(arms)):
            arm = arms[(i + k) % len(arms)]
            arm.run(i, request(PROMPT, [images[image]], max_tokens=max_tokens,
                               cache_salt=arm.name, ignore_eos=True))


@contextmanager
def serving_process(name: str, args: list[str], tmp: Path,
                    ) -> Iterator[generate_pb2_grpc.GenerationStub]:
    """``tandem NAME ARGS --listen 127.0.0.1:PORT`` (the gateway) until it serves the
    cells' health through its port; stopped with SIGTERM afterwards."""
    port = free_port()
    cmd = [sys.executable, "-m", "tandem_cli.cli", name, *args, "--listen", f"127.0.0.1:{port}"]
    log_path = tmp / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        wait_serving(health_pb2_grpc.HealthStub(channel), proc, log_path)
        yield generate_pb2_grpc.GenerationStub(channel)
    finally:
        channel.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


@contextmanager
def round_robin_envoy(cells: list[Cell], tmp: Path) -> Iterator[generate_pb2_grpc.GenerationStub]:
    """Envoy with ``tandem gateway``'s fail-open bootstrap and a picker port nobody serves:
    every request takes the fallback cluster, round robin over the cells."""
    endpoints = tuple(CellEndpoint(host, int(port), 1, host)
                      for host, _, port in (c.target.rpartition(":") for c in cells))
    config = GatewayConfig(EppConfig(cells=endpoints), f"127.0.0.1:{free_port()}",
                           free_port(), fail_open=True)
    workdir = tmp / "envoy-rr"
    workdir.mkdir()
    write_cells(workdir / "cells", endpoints)
    proc = start_envoy(gateway_bootstrap(config, free_port(), workdir / "cells"), workdir)
    channel = grpc.insecure_channel(config.listen)
    try:
        wait_envoy_ready(proc, config.admin_port, workdir)
        # Fail-open takes effect once Envoy's health check has marked the picker down.
        wait_serving(health_pb2_grpc.HealthStub(channel), proc, workdir / "envoy.log")
        yield generate_pb2_grpc.GenerationStub(channel)
    finally:
        channel.close()
        stop_envoy(proc)


def wait_serving(health: health_pb2_grpc.HealthStub, proc: subprocess.Popen, log: Path) -> None:
    check = health_pb2.HealthCheckRequest(service="tandem.v1.Generation")
    deadline = time.monotonic() + 60
    while True:
        try:
            if health.Check(check, timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"{log.stem} not serving:\n{log.read_text()}")
        time.sleep(0.2)


def start_cells(tmp: Path, stack: ExitStack, count: int = 3) -> list[Cell]:
    """Cells started in parallel (each takes several seconds to load its model)."""
    managers = [running_cell(tmp / f"cell{i}") for i in range(count)]
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(m.__enter__) for m in managers]
        cells = []
        for manager, future in zip(managers, futures, strict=True):
            cells.append(future.result())
            stack.push(manager)
    return cells


def print_environment(args: argparse.Namespace) -> None:
    print(f"python {platform.python_version()}, torch {torch.__version__}, grpcio "
          f"{grpc.__version__}, {platform.machine()} {platform.system()}, "
          f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}")
    print(f"workload: {args.requests} requests, {args.images} distinct {args.image_size} PNGs "
          f"(Zipf s={args.zipf_s}), {args.max_tokens} generated tokens each, one at a time; "
          "3 cells (model tiny, CPU, test harness: TANDEM_DEBUG_INVARIANTS=1)")


def print_results(arms: list[Arm], seq: list[int]) -> None:
    ceiling = 1 - len(set(seq)) / len(seq)
    print(f"\n{'arm':<12} {'mm hit':>7} {'prefix hit':>10} {'encoder':>7} {'gen tok/s':>9} "
          f"{'prompt tok/s':>12} {'ms/req':>7} {'TTFT p50':>8} {'TTFT p99':>8}  per cell   "
          "errors")
    for arm in arms:
        spread = "/".join(str(n) for n in sorted(arm.per_cell.values(), reverse=True))
        n = max(sum(arm.per_cell.values()), 1)
        print(f"{arm.name:<12} {arm.rate('mm_cache_hits', 'mm_items'):>7.1%} "
              f"{arm.rate('cached_prompt_tokens', 'prompt_tokens'):>10.1%} "
              f"{arm.usage['encoder_runs']:>7} {arm.per_s('completion_tokens'):>9.2f} "
              f"{arm.per_s('prompt_tokens'):>12.1f} {1000 * arm.seconds / n:>7.0f} "
              f"{arm.ttft_ms(50):>8.1f} {arm.ttft_ms(99):>8.1f}  {spread:<10} "
              f"{dict(arm.errors) or 0}")
    print(f"{'one cell':<12} {ceiling:>7.1%}  (ceiling: every repeat of an image hits)")
    rr = arms[0]
    rr_hits = max(rr.rate("mm_cache_hits", "mm_items"), 1e-9)
    for arm in arms[1:]:
        hits = arm.rate("mm_cache_hits", "mm_items")
        print(f"{arm.name} / round-robin: mm hit rate x{hits / rr_hits:.2f}, tokens/s "
              f"x{arm.per_s('completion_tokens') / rr.per_s('completion_tokens'):.2f}; "
              f"{hits / ceiling:.0%} of the one-cell ceiling")
    affinity, envoy_rr, gateway = (next(a for a in arms if a.name == n)
                                   for n in ("affinity", "envoy-rr", "gateway"))
    for base, note in ((envoy_rr, "the same hop without affinity"),
                       (affinity, "the policy alone; target >= 0.95")):
        hits = gateway.rate("mm_cache_hits", "mm_items") / max(
            base.rate("mm_cache_hits", "mm_items"), 1e-9)
        tps = gateway.per_s("completion_tokens") / base.per_s("completion_tokens")
        print(f"gateway / {base.name} ({note}): mm hit rate x{hits:.2f}, tokens/s x{tps:.2f}, "
              f"TTFT p50 {gateway.ttft_ms(50) - base.ttft_ms(50):+.1f} ms, "
              f"p99 {gateway.ttft_ms(99) - base.ttft_ms(99):+.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small run (~2 minutes)")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--images", type=int, default=24)
    p.add_argument("--image-size", default="448x336", help="WIDTHxHEIGHT of the PNGs")
    p.add_argument("--zipf-s", type=float, default=1.1)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.requests, args.images, args.max_tokens = 36, 12, 4
    print_environment(args)
    width, height = (int(v) for v in args.image_size.split("x"))
    seq = zipf_sequence(args.requests, args.images, args.zipf_s, args.seed)
    images = [png(10_000 + i, width, height) for i in range(args.images)]
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        tmp = Path(d)
        cells = start_cells(tmp, stack)
        targets = ",".join(c.target for c in cells)
        envoy_rr = stack.enter_context(round_robin_envoy(cells, tmp))
        gateway = stack.enter_context(serving_process(
            "gateway", ["--cells", targets, "--admin-port", str(free_port()),
                        "--epp-listen", f"127.0.0.1:{free_port()}"], tmp))
        for i, cell in enumerate(cells):  # first requests pay one-off start-up costs
            cell.generate(PROMPT, [png(i, width, height)], max_tokens=2, cache_salt="warmup")
        arms = make_arms(cells, envoy_rr, gateway)
        run(arms, images, seq, args.max_tokens)
    print_results(arms, seq)


if __name__ == "__main__":
    main()
