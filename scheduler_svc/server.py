"""The scheduler process: processor cache, worker pool, engine, the public gRPC server and
the OpenAI-compatible HTTP port (same engine, same loop)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.http_backend import EngineBackend
from scheduler_svc.servicer import GenerationServicer
from scheduler_svc.worker_client import WorkerPool
from tandem.grpc_server import GrpcServer, tcp_binder, tls_mode
from tandem.metrics import MetricsEndpoint, RequestLatency, Sample, SnapshotCollector
from tandem.openai_api.http_server import HttpServer
from tandem.processor_cache import (
    LruProcessorCache,
    ProcessorCache,
    ShmProcessorCache,
)
from tandem.request_limits import max_http_body_bytes, max_message_bytes
from tandem.shared_dir import prepare_shared_dir
from tandem.shutdown import serve_until_signalled
from tandem.tls import server_credentials
from tandem.v1 import generate_pb2, generate_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass
class SchedulerServer:
    grpc: GrpcServer
    port: int
    engine: Engine
    cache: ProcessorCache
    workers: WorkerPool
    metrics: MetricsEndpoint | None = None
    http: HttpServer | None = None

    async def stop(self, grace: float) -> None:
        """Health NOT_SERVING and new calls refused at once, on the gRPC and the HTTP port
        -> running streams finish while the engine keeps stepping (up to ``grace``; the
        rest are cancelled, which aborts their requests) -> close the health-only port ->
        stop the engine -> close worker channels -> unlink the segment -> stop serving
        metrics."""
        await asyncio.gather(self.grpc.stop(grace),
                             *([self.http.stop(grace)] if self.http is not None else []))
        await self.engine.stop()
        await self.workers.close()
        self.cache.close()
        if self.metrics is not None:
            await self.metrics.close()


def make_cache(config: SchedulerConfig) -> ProcessorCache:
    if config.mm_cache == "shm":
        shm_dir = Path(config.shm_dir)
        prepare_shared_dir(shm_dir, config.shm_group_mode)
        return ShmProcessorCache(shm_dir, config.mm_cache_size, config.num_workers,
                                 config.mm_cache_max_object_size,
                                 mode=0o640 if config.shm_group_mode else 0o600)
    if config.mm_cache == "lru":
        return LruProcessorCache(config.mm_cache_size)
    if config.mm_cache == "none":
        return ProcessorCache()
    raise ValueError(f"unknown --mm-cache {config.mm_cache!r}: use shm, lru or none")


async def create_server(config: SchedulerConfig) -> SchedulerServer:
    """Start everything; returns once the workers are described and Generate is served."""
    credentials = server_credentials(config.tls)  # bad TLS files fail before anything starts
    cache = make_cache(config)
    workers = WorkerPool(list(config.worker_addresses))
    limits = config.limits
    max_message = max_message_bytes(limits.max_images, limits.max_image_bytes)
    public = GrpcServer.create(SERVICE_NAME, [
        ("grpc.max_receive_message_length", max_message),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000)])
    engine = Engine(config, cache, workers, public.set_serving)
    registry = CollectorRegistry() if config.metrics_port or config.http_metrics else None
    latency = None
    if registry is not None:
        registry.register(SnapshotCollector(lambda: metric_values(engine)))
        registry.register(engine.mask_time)
        latency = RequestLatency(registry)
    generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(engine, latency),
                                                       public.server)
    http = None
    try:
        port = await public.start(tcp_binder(config.listen, credentials), config.health_listen)
        if config.http.listen:  # bound before the workers answer, as gRPC is: 503 until then
            http = await HttpServer.start(EngineBackend(engine, latency), config.http,
                                          config.tls, max_http_body_bytes(max_message),
                                          registry if config.http_metrics else None)
        await engine.start()
        metrics = (None if registry is None or not config.metrics_port
                   else await MetricsEndpoint.start(registry, config.metrics_port))
    except BaseException:
        if http is not None:
            await http.stop(0)
        await public.stop(0)
        await engine.stop()
        await workers.close()
        cache.close()
        raise
    log.info("scheduler serving %s on port %d, %s (%d workers, cache %s)%s", SERVICE_NAME,
             port, tls_mode(credentials, config.tls.ca), config.num_workers, cache.kind,
             "" if http is None else f", OpenAI-compatible HTTP on port {http.port}")
    return SchedulerServer(public, port, engine, cache, workers, metrics, http)


def metric_values(engine: Engine) -> dict[str, Sample]:
    """The scheduler's totals and gauges, read at scrape time (names: tandem.metrics)."""
    stats, counters, ledger = engine.cache_stats(), engine.counters, engine.ledger_stats()
    refused = engine.cache.counters().refused
    waiting, waiting_bytes = engine.admission.waiting()
    return model_server_metrics(engine, waiting, stats) | {
        "tandem_mm_cache_refused_total": {r: refused.get(r, 0) for r in ("oversize", "full")},
        "tandem_worker_losses_total": engine.worker_losses,
        "tandem_prompt_tokens_total": counters.prompt_tokens,
        "tandem_prefix_cache_hit_tokens_total": counters.prefix_cache_hit_tokens,
        "tandem_mm_cache_hits_total": stats.mm_cache_hits_total,
        "tandem_mm_cache_misses_total": stats.mm_cache_misses_total,
        "tandem_encoder_runs_total": counters.encoder_runs,
        "tandem_preemptions_total": counters.preemptions,
        "tandem_shm_capacity_bytes": stats.shm_capacity_bytes,
        "tandem_shm_used_bytes": stats.shm_used_bytes,
        "tandem_shm_objects": stats.shm_objects,
        "tandem_shm_unacked_refs": stats.shm_unacked_refs,
        "tandem_shm_ledger_refs": ledger.refs,
        "tandem_shm_in_doubt_refs": ledger.in_doubt,
        "tandem_shm_released_in_doubt_total": ledger.released_in_doubt,
        "tandem_engine_errors_total": engine.errors,
        "tandem_invariant_checks_total": engine.invariant_checks,
        "tandem_waiting_requests": waiting,
        "tandem_waiting_image_bytes": waiting_bytes,
        "tandem_rejected_requests_total": dict(engine.admission.rejected),
        "tandem_kv_blocks_total": stats.kv_blocks_total,
        "tandem_kv_blocks_free": stats.kv_blocks_free,
        "tandem_mm_cache_capacity_bytes": stats.mm_cache_capacity_bytes,
        "tandem_mm_cache_estimated_hit_ratio": {str(p.capacity_bytes): p.hit_ratio
                                                for p in stats.mm_cache_curve},
        "tandem_mm_cache_achievable_hit_ratio": stats.mm_cache_achievable_hit_ratio,
        "tandem_mm_cache_recommended_bytes": stats.mm_cache_recommended_bytes,
        "tandem_mm_cache_curve_references_total": stats.mm_cache_curve_references,
    }


def model_server_metrics(engine: Engine, waiting: int,
                         stats: generate_pb2.CacheStatsResponse) -> dict[str, Sample]:
    """The gauges of the inference extension's model-server protocol, under vLLM's names;
    before the workers are described the cell has no KV blocks and reports no cache config
    (an endpoint picker then sees an empty, idle cell)."""
    total, free = stats.kv_blocks_total, stats.kv_blocks_free
    running = len(engine.scheduler.running) if engine.scheduler is not None else 0
    values: dict[str, Sample] = {
        "vllm:num_requests_waiting": waiting,
        "vllm:num_requests_running": running,
        "vllm:kv_cache_usage_perc": (total - free) / total if total else 0.0,
    }
    if total:
        values["vllm:cache_config_info"] = {(str(engine.config.block_size), str(total)): 1.0}
    return values


async def serve(config: SchedulerConfig) -> None:
    """Run until SIGTERM or SIGINT, then shut down in order (see SchedulerServer.stop)."""
    http = f", HTTP on {config.http.listen}" if config.http.listen else ""
    await serve_until_signalled(
        create_server(config), f"tandem scheduler listening on {config.listen}{http}",
        config.shutdown_grace_s)
