"""Prometheus metrics of the endpoint picker's balancer: decisions per cell and reason,
load, health."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router_svc.balancer import REASONS, Balancer
from tandem.metrics import MetricsEndpoint


async def start_metrics(balancer: Balancer | Callable[[], Balancer], port: int,
                        registry: CollectorRegistry | None = None) -> MetricsEndpoint:
    """``/metrics`` on ``port``: the balancer's metrics plus those of ``registry``
    (``balancer`` may be a function giving the current one: the picker's cells change)."""
    registry = registry or CollectorRegistry()
    registry.register(BalancerCollector(balancer))
    return await MetricsEndpoint.start(registry, port)


class BalancerCollector(Collector):
    """Reads the balancer's own counters at scrape time (nothing is counted twice);
    ``balancer`` is the one to read, or a function giving the current one."""

    def __init__(self, balancer: Balancer | Callable[[], Balancer]) -> None:
        self._balancer = balancer

    def collect(self) -> Iterator[Metric]:
        b = self._balancer if isinstance(self._balancer, Balancer) else self._balancer()
        decisions = CounterMetricFamily(
            "tandem_route_decisions", "Requests routed, by cell and reason "
            "(affinity: the key's own cell; spill: over the load bound; failover: cell down)",
            labels=["cell", "reason"])
        for cell in b.cells:
            for reason in REASONS:
                decisions.add_metric([cell, reason], b.decisions[(cell, reason)])
        yield decisions
        in_flight = GaugeMetricFamily("tandem_route_in_flight", "Requests in flight per cell",
                                      labels=["cell"])
        healthy = GaugeMetricFamily("tandem_route_cell_serving",
                                    "1 while the cell's health is SERVING", labels=["cell"])
        for cell in b.cells:
            in_flight.add_metric([cell], b.in_flight[cell])
            healthy.add_metric([cell], int(cell in b.healthy))
        yield in_flight
        yield healthy
