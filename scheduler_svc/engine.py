"""The scheduler's engine: one asyncio task that steps the workers while there is work.

Requests enter through :meth:`Engine.generate`, which yields their step outputs; the loop
in :meth:`Engine._run` schedules, sends the step to every worker, and routes what they
sampled back to each request's queue. All scheduling state is touched only on the event
loop's thread; image decoding runs in a thread pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.encoder_cache import EncoderCacheManager
from scheduler_svc.image_processor import ImageProcessorConfig
from scheduler_svc.input_processor import InputProcessor
from scheduler_svc.kv_cache_manager import KVCacheManager
from scheduler_svc.request import Request, StepOutput
from scheduler_svc.request_telemetry import RequestTrace, step_trace_context
from scheduler_svc.scheduler import (
    Scheduler,
    SchedulerCounters,
    SchedulerLimits,
    SchedulerOutput,
)
from scheduler_svc.step_message import build_step_request, mark_delivered
from scheduler_svc.worker_client import StepFailed, WorkerPool
from tandem import tracing
from tandem.errors import InvalidInput, Unavailable
from tandem.features import MultiModalKwargsItem
from tandem.processor_cache import SEGMENT_FILE, ProcessorCache, ShmProcessorCache
from tandem.shm import ShmDescriptor
from tandem.v1 import generate_pb2, worker_pb2

log = logging.getLogger(__name__)

_DESCRIBE_TIMEOUT_S = 30.0
_RECONNECT_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    uses_mrope: bool
    patch_size: int
    merge_size: int
    num_kv_blocks: int
    block_size: int
    max_seq_len: int  # positions the model supports: prompt + outputs must fit


class Engine:
    """Owns the scheduler, the processor cache and the worker pool.

    ``on_serving(bool)`` is called whenever the cell starts or stops being able to serve
    (all workers described / a worker lost), so health can follow. A worker is lost when
    a step fails on it or its health stream ends (it may die while the cell is idle);
    ``_epoch`` counts the losses, so a step that was in flight across one is ignored.
    """

    def __init__(self, config: SchedulerConfig, cache: ProcessorCache, workers: WorkerPool,
                 on_serving: Callable[[bool], None] = lambda _: None) -> None:
        self.config = config
        self.cache = cache
        self.workers = workers
        self._on_serving = on_serving
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="image")
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._serving_again = asyncio.Event()
        self._epoch = 0
        self._step_id = 0
        self.counters = SchedulerCounters()
        self._debug_invariants = os.environ.get("TANDEM_DEBUG_INVARIANTS") == "1"
        self.serving = False
        self.model: ModelInfo | None = None
        self.scheduler: Scheduler | None = None
        self.inputs: InputProcessor | None = None

    async def start(self) -> None:
        """Describe the workers, size the caches from them, start the loop."""
        self.model = _model_info(await self.workers.describe(_DESCRIBE_TIMEOUT_S))
        if self.model.block_size != self.config.block_size:
            raise RuntimeError(f"workers use block size {self.model.block_size}, the scheduler "
                               f"{self.config.block_size}: configure both the same")
        self._reset_state()
        c = self.config
        images = ImageProcessorConfig(
            patch_size=self.model.patch_size, merge_size=self.model.merge_size,
            min_pixels=c.min_pixels, max_pixels=c.max_pixels,
            max_image_bytes=c.limits.max_image_bytes, max_image_pixels=c.limits.max_image_pixels)
        c.check_image_budget(images.factor)
        max_tokens = min(self.model.num_kv_blocks * c.block_size, self.model.max_seq_len)
        self.inputs = InputProcessor(c.limits, images, max_tokens)
        self._task = asyncio.create_task(self._run(), name="engine-loop")
        self._set_serving(True)
        self._watch_task = asyncio.create_task(self._watch_workers(), name="worker-watch")

    def _reset_state(self) -> None:
        """Fresh KV and encoder bookkeeping: the workers' caches are empty (start, restart)."""
        assert self.model is not None
        c = self.config
        kv = KVCacheManager(self.model.num_kv_blocks, c.block_size, c.enable_prefix_caching)
        limits = SchedulerLimits(c.max_num_seqs, c.max_num_batched_tokens,
                                 c.max_num_batched_tokens)
        self.scheduler = Scheduler(limits, kv, EncoderCacheManager(c.encoder_cache_embeds),
                                   self._redeliver, self.counters)

    async def generate(
        self, msg: generate_pb2.GenerateRequest, trace: RequestTrace | None = None
    ) -> AsyncIterator[tuple[Request, StepOutput]]:
        """Validate and enqueue ``msg``; yield (request, output) per step until it finishes.

        Leaving the iteration early (the client cancelled or its deadline passed) aborts
        the request and releases everything it holds. ``trace`` (tracing on) gets the
        request's image spans and scheduling events.
        """
        if not self.serving or self.inputs is None or self.scheduler is None:
            raise Unavailable("the cell is not serving: its workers are not ready")
        request = await self.inputs.to_request(msg, self.cache, self._offload, trace)
        if request.request_id in self.scheduler.requests:
            self._release_undelivered(request)
            raise InvalidInput(f"request_id {request.request_id!r} is already in use",
                               "DUPLICATE_REQUEST_ID")
        self.scheduler.add_request(request)
        if trace is not None:
            trace.event("queued", {"waiting": len(self.scheduler.waiting)})
        self._wake.set()
        try:
            while True:
                out = await request.outputs.get()
                if isinstance(out, BaseException):
                    raise out
                yield request, out
                if out.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
                    return
        finally:
            if not request.is_finished:
                self.abort(request)

    def abort(self, request: Request, reason: int = generate_pb2.FINISH_REASON_ABORT) -> None:
        """Stop a request: blocks, encoder entries and undelivered SHM references freed."""
        assert self.scheduler is not None
        self._release_undelivered(request)
        self.scheduler.finish(request, reason)
        self._wake.set()

    def _release_undelivered(self, request: Request) -> None:
        if request.undelivered:
            for f in request.features:
                self.cache.release(f.data)
            request.undelivered = False

    def _redeliver(self, request: Request) -> None:
        """Fresh data for a preempted request whose SHM references were spent.

        Re-processing (when the object was evicted) runs inline: preemption is rare and the
        scheduler must hand a complete request to this step.
        """
        assert self.inputs is not None
        if not any(isinstance(f.data, ShmDescriptor) for f in request.features):
            return
        with self.cache.pinned([f.identifier for f in request.features]):
            for i, (f, media) in enumerate(zip(request.features, request.media, strict=True)):
                data = self.cache.lookup(f.identifier)
                if data is None:
                    data = self.cache.store(f.identifier, self.inputs.process(media))
                request.features[i] = replace(f, data=data)
        request.undelivered = True

    async def _offload(self, fn: Callable[[], MultiModalKwargsItem]) -> MultiModalKwargsItem:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            if not self.serving or self.scheduler is None or not self.scheduler.has_work:
                self._wake.clear()
                continue
            out = self.scheduler.schedule()
            if out.is_empty:
                self._wake.clear()
                await asyncio.sleep(0.01)  # nothing fits now; retry after others change
                self._wake.set()
                continue
            await self._step(out)

    async def _step(self, out: SchedulerOutput) -> None:
        assert self.scheduler is not None and self.model is not None
        self._step_id += 1
        segment, generation = self._segment()
        trace_context = (step_trace_context(out, self.scheduler.requests, self.config.block_size)
                         if tracing.enabled() else None)
        msg = build_step_request(out, self._step_id, segment, generation, self.model.uses_mrope,
                                 trace_context)
        mark_delivered(out)
        epoch = self._epoch
        try:
            result = await self.workers.step(msg, self.config.step_timeout_s)
        except StepFailed as exc:
            if epoch == self._epoch:
                self._worker_failed(exc.ranks, str(exc))
            else:  # the loss is being handled; no step was sent since
                self._reset_slots(exc.ranks)
            return
        if epoch != self._epoch:
            return  # a worker was lost meanwhile: these requests have failed already
        for request, output in self.scheduler.update(out, result.sampled):
            request.outputs.put_nowait(output)
        if self._debug_invariants:
            self.check_invariants()

    def check_invariants(self) -> None:
        """Every bookkeeping structure, whole (after each step with TANDEM_DEBUG_INVARIANTS=1)."""
        assert self.scheduler is not None
        self.scheduler.kv.check_invariants()
        self.scheduler.encoder.check_invariants()
        if isinstance(self.cache, ShmProcessorCache):
            self.cache.writer.check_invariants()

    def _segment(self) -> tuple[str, int]:
        if isinstance(self.cache, ShmProcessorCache):
            return SEGMENT_FILE, self.cache.writer.generation
        return "", 0

    async def _watch_workers(self) -> None:
        while True:
            await self._serving_again.wait()
            epoch = self._epoch
            rank = await self.workers.wait_lost()
            if self.serving and epoch == self._epoch:  # else a failed step noticed first
                self._worker_failed((rank,), f"worker {rank}: health stream ended")

    def _worker_failed(self, ranks: tuple[int, ...], why: str) -> None:
        """Fail every request with UNAVAILABLE, forget worker state, wait for the workers."""
        assert self.scheduler is not None
        log.error("worker lost (%s): failing in-flight requests", why)
        self._epoch += 1
        self._set_serving(False)
        error = Unavailable(f"worker {ranks[0]} failed; retry the request")
        for request in list(self.scheduler.requests.values()):
            self.abort(request)
            request.outputs.put_nowait(error)
        self._reset_slots(ranks)  # after the undelivered references were released
        request_ids, mm_hashes = self.scheduler.leftovers()
        self._reset_state()
        self.scheduler.release_on_workers(request_ids, mm_hashes)  # for surviving workers
        asyncio.get_running_loop().create_task(self._reconnect())

    def _reset_slots(self, ranks: tuple[int, ...]) -> None:
        """A dead worker will never acknowledge what it was sent, and a live one that
        refused a step acknowledged none of it: count their references as acknowledged."""
        if isinstance(self.cache, ShmProcessorCache):
            for rank in ranks:
                self.cache.writer.reset_reader_slot(rank)

    async def _reconnect(self) -> None:
        while True:
            try:
                await self.workers.describe(_RECONNECT_TIMEOUT_S)
            except Unavailable:
                await asyncio.sleep(0.2)
                continue
            log.info("workers are back; serving again")
            self._set_serving(True)
            return

    @property
    def worker_losses(self) -> int:
        return self._epoch

    def _set_serving(self, serving: bool) -> None:
        self.serving = serving
        self._on_serving(serving)
        if serving:
            self._serving_again.set()
        else:
            self._serving_again.clear()
        self._wake.set()

    def cache_stats(self) -> generate_pb2.CacheStatsResponse:
        counters = self.cache.counters()
        msg = generate_pb2.CacheStatsResponse(
            mm_cache_type=self.cache.kind, mm_cache_hits_total=counters.hits,
            mm_cache_misses_total=counters.misses)
        if isinstance(self.cache, ShmProcessorCache):
            s = self.cache.writer.stats()
            msg.shm_capacity_bytes, msg.shm_used_bytes = s.capacity, s.used_bytes
            msg.shm_objects, msg.shm_unacked_refs = s.objects, s.unacked_refs
        if self.scheduler is not None:
            kv = self.scheduler.kv
            msg.prefix_cache_blocks = kv.prefix_cache_blocks
            msg.prefix_cache_hit_tokens_total = self.counters.prefix_cache_hit_tokens
            msg.kv_blocks_total, msg.kv_blocks_free = kv.pool.num_blocks, kv.num_free_blocks
        return msg

    async def stop(self) -> None:
        """Abort everything in flight, stop the loop, release the pool (not the cache)."""
        self._set_serving(False)
        if self.scheduler is not None:
            for request in list(self.scheduler.requests.values()):
                self.abort(request)
                request.outputs.put_nowait(Unavailable("the server is shutting down"))
        tasks = [t for t in (self._task, self._watch_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)


def _model_info(describes: Sequence[worker_pb2.DescribeResponse]) -> ModelInfo:
    first = describes[0]
    cfg = json.loads(first.model_config_json)
    ranks = sorted(d.rank for d in describes)
    if ranks != list(range(len(describes))):
        raise RuntimeError(f"worker ranks {ranks} are not 0..{len(describes) - 1}")
    return ModelInfo(
        name=first.model, uses_mrope=cfg.get("position_scheme") == "mrope",
        patch_size=int(cfg.get("patch_size", 14)), merge_size=int(cfg.get("merge_size", 2)),
        num_kv_blocks=min(d.num_kv_blocks for d in describes), block_size=first.block_size,
        max_seq_len=int(cfg.get("max_seq_len", 1 << 30)))
