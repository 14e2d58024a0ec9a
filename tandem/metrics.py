"""Prometheus metrics of the scheduler and the worker, served as text on ``/metrics``.

Totals and gauges are not kept twice: a :class:`SnapshotCollector` reads the service's own
counters (``SchedulerCounters``, the processor cache, the segment writer, the worker's step
totals) when Prometheus scrapes. Only the latency histograms are observed as requests end.
Every name is declared in :data:`METRICS` with its type and help text; docs/observability.md
lists them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

COUNTER, GAUGE = "counter", "gauge"

METRICS: dict[str, tuple[str, str]] = {
    "tandem_prompt_tokens_total":
        (COUNTER, "Prompt tokens admitted (image placeholders expanded), counted once per request"),
    "tandem_prefix_cache_hit_tokens_total":
        (COUNTER, "Prompt tokens served from the KV prefix cache"),
    "tandem_mm_cache_hits_total": (COUNTER, "Images found in the processor cache"),
    "tandem_mm_cache_misses_total": (COUNTER, "Images processed because the cache missed"),
    "tandem_encoder_runs_total": (COUNTER, "Images run through the vision encoder"),
    "tandem_preemptions_total": (COUNTER, "Requests preempted (recomputed) for lack of KV blocks"),
    "tandem_mm_cache_refused_total":
        (COUNTER, "Processed images the segment refused (sent inline instead), by reason"),
    "tandem_worker_losses_total":
        (COUNTER, "Times a worker was lost (failed step or ended health stream)"),
    "tandem_shm_capacity_bytes": (GAUGE, "Data-area size of the shared feature segment"),
    "tandem_shm_used_bytes": (GAUGE, "Segment bytes held by live objects"),
    "tandem_shm_objects": (GAUGE, "Objects in the segment"),
    "tandem_shm_unacked_refs": (GAUGE, "Segment references not yet acknowledged by every worker"),
    "tandem_shm_ledger_refs":
        (GAUGE, "Segment references the delivery ledger accounts for (held, in flight, in doubt)"),
    "tandem_shm_in_doubt_refs":
        (GAUGE, "Segment references whose delivery to some worker is unknown (its step failed)"),
    "tandem_shm_released_in_doubt_total":
        (COUNTER, "In-doubt segment references no worker acknowledged, released"),
    "tandem_engine_errors_total":
        (COUNTER, "Unexpected errors the engine loop caught (each failed the cell's requests)"),
    "tandem_invariant_checks_total":
        (COUNTER, "Whole-cell invariant checks passed (TANDEM_DEBUG_INVARIANTS=1, every step)"),
    "tandem_mm_cache_capacity_bytes": (GAUGE, "Bytes the processor cache may hold"),
    "tandem_mm_cache_estimated_hit_ratio":
        (GAUGE, "Estimated LRU hit ratio of the images seen so far at a processor-cache "
                "capacity (docs/cache-sizing.md), by capacity in bytes"),
    "tandem_mm_cache_achievable_hit_ratio":
        (GAUGE, "Hit ratio an unbounded processor cache would have had on the images seen"),
    "tandem_mm_cache_recommended_bytes":
        (GAUGE, "Smallest processor cache reaching --mm-cache-target-fraction of the "
                "achievable hit ratio (0 before any image)"),
    "tandem_mm_cache_curve_references_total":
        (COUNTER, "Image references the hit-ratio estimate has seen"),
    "tandem_waiting_requests":
        (GAUGE, "Requests waiting to run: arriving (images being checked or acquired) and "
                "queued, preempted ones included (at most --max-waiting-requests)"),
    "tandem_waiting_image_bytes":
        (GAUGE, "Client image bytes the waiting requests hold (--max-waiting-image-bytes)"),
    "tandem_rejected_requests_total":
        (COUNTER, "Requests refused at admission (RESOURCE_EXHAUSTED / HTTP 429), by the "
                  "limit they hit: requests or image_bytes"),
    "tandem_kv_blocks_total": (GAUGE, "KV blocks of the cell"),
    "tandem_kv_blocks_free": (GAUGE, "KV blocks free (cached-but-unreferenced included)"),
    "tandem_steps_total": (COUNTER, "Steps run by this worker"),
    "tandem_shm_resolved_total": (COUNTER, "Segment descriptors whose payload this worker read"),
    "tandem_shm_acked_total": (COUNTER, "Segment descriptors this worker acknowledged"),
    "tandem_torch_threads":
        (GAUGE, "Threads of this worker's torch team now (fewer while they wait for CPUs)"),
    # The model-server protocol of the Gateway API Inference Extension, under the vLLM names a
    # stock endpoint picker reads by default (docs/routing.md, "Gateway API Inference
    # Extension"); the tandem_* metrics above stay the cell's own account.
    "vllm:num_requests_waiting": (GAUGE, "Requests waiting to run (tandem_waiting_requests)"),
    "vllm:num_requests_running": (GAUGE, "Requests running: admitted, holding KV blocks"),
    "vllm:kv_cache_usage_perc":
        (GAUGE, "Fraction of the cell's KV blocks in use, 0 to 1 (1 - free / total)"),
    "vllm:cache_config_info":
        (GAUGE, "The KV cache's configuration as labels: tokens per block, blocks (value 1)"),
}

# Metrics whose value is a mapping: label value -> sample, under this one label name; or,
# with several label names, tuple of label values -> sample.
LABELS: dict[str, tuple[str, ...]] = {
    "tandem_mm_cache_refused_total": ("reason",),
    "tandem_rejected_requests_total": ("limit",),
    "tandem_mm_cache_estimated_hit_ratio": ("capacity_bytes",),
    "vllm:cache_config_info": ("block_size", "num_gpu_blocks"),
}

_TTFT_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1.0)
_DURATION_BUCKETS = (.05, .1, .25, .5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


# Structured output: token masks cost from ~0.1 ms (a few rows, a small vocabulary) to tens
# of ms (many rows' first masks in a large vocabulary).
_MASK_BUCKETS = (.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, 1.0)


def scheduler_mask_seconds() -> Histogram:
    """Per step with token masks, the scheduler's time computing them, sent and deferred
    ones (unregistered: the scheduler's server registers it when it serves metrics)."""
    return Histogram("tandem_scheduler_mask_seconds",
                     "Scheduler time computing a step's token masks (structured output; "
                     "steps with masks only)", registry=None, buckets=_MASK_BUCKETS)


def worker_mask_wait_seconds() -> Histogram:
    """Per step with deferred masks, how long the worker waited for them after its forward
    (unregistered: the worker's server registers it when it serves metrics)."""
    return Histogram("tandem_worker_mask_wait_seconds",
                     "Worker wait, after the forward, for a step's deferred token masks "
                     "(steps with deferred masks only)", registry=None, buckets=_MASK_BUCKETS)


Sample = float | Mapping[str, float] | Mapping[tuple[str, ...], float]


class SnapshotCollector(Collector):
    """Turns ``read()`` (metric name -> value, names from :data:`METRICS`) into samples; the
    value of a name in :data:`LABELS` maps label values to samples."""

    def __init__(self, read: Callable[[], Mapping[str, Sample]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        for name, value in self._read().items():
            kind, doc = METRICS[name]
            labels = list(LABELS[name]) if name in LABELS else None
            family = (CounterMetricFamily(name.removesuffix("_total"), doc, labels=labels)
                      if kind == COUNTER else GaugeMetricFamily(name, doc, labels=labels))
            if isinstance(value, Mapping):
                for label, sample in value.items():
                    family.add_metric(list(label) if isinstance(label, tuple) else [label],
                                      sample)
            else:
                family.add_metric([], value)
            yield family


class RequestLatency:
    """The three request histograms, in seconds, as the GenAI server metrics define them.

    Time to first token and duration run from the arrival of the Generate call; time per
    output token is (duration - TTFT) / (outputs - 1), observed only with 2+ outputs.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram("tandem_time_to_first_token_seconds",
                              "Generate arrival to the first output token", registry=registry,
                              buckets=_TTFT_BUCKETS)
        self.tpot = Histogram("tandem_time_per_output_token_seconds",
                              "Mean time between output tokens after the first",
                              registry=registry, buckets=_TPOT_BUCKETS)
        self.duration = Histogram("tandem_request_duration_seconds",
                                  "Generate arrival to its last message", registry=registry,
                                  buckets=_DURATION_BUCKETS)

    def observe(self, ttft: float | None, duration: float, output_tokens: int) -> None:
        self.duration.observe(duration)
        if ttft is None:
            return
        self.ttft.observe(ttft)
        if output_tokens > 1:
            self.tpot.observe((duration - ttft) / (output_tokens - 1))


class MetricsEndpoint:
    """``GET /metrics`` served by the process's event loop.

    NOTE: not ``prometheus_client.start_http_server``, whose thread would read the
    scheduler's state while the event loop changes it; collectors run on the loop here,
    so a scrape sees one consistent snapshot without locks.
    """

    _READ_TIMEOUT_S = 5.0

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._server: asyncio.Server | None = None

    @classmethod
    async def start(cls, registry: CollectorRegistry, port: int,
                    host: str | None = None) -> MetricsEndpoint:
        """Listen on ``port`` (all interfaces unless ``host``); Prometheus scrapes pod IPs."""
        endpoint = cls(registry)
        endpoint._server = await asyncio.start_server(endpoint._handle, host, port)
        log.info("metrics on port %d", endpoint.port)
        return endpoint

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), self._READ_TIMEOUT_S)
            while (await asyncio.wait_for(reader.readline(), self._READ_TIMEOUT_S)).strip():
                pass  # headers: nothing in them changes the answer
            method, path, *_ = [*request_line.split(), b"", b""]
            if method == b"GET" and path.split(b"?")[0] == b"/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.registry)
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"try /metrics\n"
            head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
            writer.write(head.encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
