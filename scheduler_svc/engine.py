"""The scheduler's engine: one asyncio task that steps the workers while there is work.

Requests enter through :meth:`Engine.generate`, which yields their step outputs; the loop
in :meth:`Engine._run` schedules, sends the step to every worker, and routes what they
sampled back to each request's queue. With asynchronous scheduling (the default) the
loop keeps two steps out: it schedules and sends step N+1 while the workers run step N,
then applies N's results while they run N+1, so neither the round trip nor the
scheduler's own work sits between two forwards (docs/scheduler.md). All scheduling state
is touched only on the event loop's thread; image decoding runs in a thread pool. The SHM
references of every request belong to the delivery ledger (:mod:`scheduler_svc.delivery`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from scheduler_svc.admission import Admission
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.delivery import DeliveryLedger, LedgerStats
from scheduler_svc.encoder_cache import EncoderCacheManager
from scheduler_svc.image_processor import ImageProcessorConfig
from scheduler_svc.input_processor import InputProcessor
from scheduler_svc.kv_cache_manager import KVCacheManager
from scheduler_svc.request import Request, StepOutput
from scheduler_svc.request_telemetry import step_trace_context
from scheduler_svc.request_trace import RequestTrace
from scheduler_svc.scheduler import (
    Scheduler,
    SchedulerCounters,
    SchedulerLimits,
    SchedulerOutput,
)
from scheduler_svc.step_message import build_step_request
from scheduler_svc.worker_client import SentStep, StepFailed, WorkerPool
from tandem import tracing
from tandem.errors import InvalidInput, TandemError, Unavailable
from tandem.metrics import scheduler_mask_seconds
from tandem.openai_api.tool_calls import detect_parser
from tandem.processor_cache import SEGMENT_FILE, ProcessorCache, ShmProcessorCache
from tandem.reuse_curve import ReuseCurve, capacities_around
from tandem.shm import ShmError
from tandem.structured import ConstraintCompiler, GuidanceBackend
from tandem.text import ChatMessage, HFTokenizer, TextPart, Tokenizer, load_tokenizer
from tandem.v1 import generate_pb2, worker_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")

_DESCRIBE_TIMEOUT_S = 30.0
_RECONNECT_TIMEOUT_S = 2.0
# How long a request waits for a live request holding its id to end before it is refused
# as a duplicate. The usual live holder is a stream its client just cancelled to retry
# with the same id (a proxy keeping x-request-id): its cancellation reaches the engine
# through another connection and may come a moment after the retry.
_REUSED_ID_GRACE_S = 2.0
# NOTE: the scheduler knows no memory bound for its recommendation; the operator caps it
# by the node's (docs/cache-sizing.md). Any bound here would only hide the curve's answer.
_UNBOUNDED_BYTES = 1 << 62


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the scheduler learns from the workers' Describe (docs/models.md lists the keys)."""

    name: str
    model_type: str  # "tandem" for the built-in models
    uses_mrope: bool
    patch_size: int
    merge_size: int
    num_kv_blocks: int
    block_size: int
    max_seq_len: int  # positions the model supports: prompt + outputs must fit
    vocab_size: int  # embedding rows
    image_token_id: int | None  # None: the model takes no images


@dataclass(frozen=True, slots=True)
class _Out:
    """A step sent to the workers whose results the engine has not applied yet."""

    out: SchedulerOutput
    sent: SentStep  # its step id, and the workers' answers to come


def _internal() -> TandemError:
    """What a client sees of an error the engine did not expect (details go to the log)."""
    return TandemError("internal error; see the server log")


class Engine:
    """Owns the scheduler, the delivery ledger and the worker pool.

    ``on_serving(bool)`` is awaited (in a task the engine keeps) whenever the cell starts or
    stops being able to serve, so health can follow. A worker is lost when a step fails on
    it for any reason but a refusal, or its health stream ends (it may die while the cell
    is idle); losses are handled by the loop between steps, never during one.

    The loop is guarded: an exception it did not expect fails the requests of the cell
    with INTERNAL (logged once, with the traceback), resets the bookkeeping and goes on;
    a second one before any step succeeded again, or a failure to reset, turns the cell
    NOT_SERVING for good.
    """

    def __init__(self, config: SchedulerConfig, cache: ProcessorCache, workers: WorkerPool,
                 on_serving: Callable[[bool], Awaitable[None]] | None = None) -> None:
        self.config = config
        self.cache = cache
        self.workers = workers
        self._on_serving = on_serving
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="image")
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()  # every task the engine started
        self._serving_again = asyncio.Event()
        self._lost: list[int] = []  # ranks whose health stream ended, for the loop
        self._losses = 0
        self._step_id = 0
        # Steps sent and not applied yet, oldest first: at most _depth of them.
        self._out: deque[_Out] = deque()
        self._depth = 2 if config.async_scheduling else 1
        # Applied outputs not yet handed to their streams: with no step out, they wait
        # until the next one is on its way (see _send); every path that does not start a
        # step hands them over first.
        self._undelivered: list[tuple[Request, StepOutput]] = []
        self._ids_changed = asyncio.Event()  # set (and replaced) by _id_released
        self._failed_since_success = False  # an unexpected error, and no step succeeded since
        self._broken = False  # NOT_SERVING for good: the loop could not go on
        self.errors = 0  # unexpected errors the loop caught
        self.invariant_checks = 0  # passed, with TANDEM_DEBUG_INVARIANTS=1
        self.counters = SchedulerCounters()
        self.mask_time = scheduler_mask_seconds()
        # Every processor-cache reference since start (the delivery ledger feeds it); it
        # outlives resets like the counters: the stream it measures is the clients'.
        self.reuse = ReuseCurve()
        self._reuse_checked = 0  # references when its invariants last held
        self._debug_invariants = os.environ.get("TANDEM_DEBUG_INVARIANTS") == "1"
        self.serving = False
        self.model: ModelInfo | None = None
        # The scheduler's own model files, read before waiting for any worker, so a bad
        # tokenizer or chat template fails the start at once and by name.
        self.tokenizer = load_tokenizer(config.model)
        # Asked once: model_info runs on every HTTP request, and asking renders a template.
        self._has_chat_template = _has_chat_template(self.tokenizer)
        self._tool_call_parser = _tool_call_parser(config.tool_call_parser, self.tokenizer)
        self._images = (ImageProcessorConfig.from_pretrained_dir(config.model)
                        if isinstance(self.tokenizer, HFTokenizer)
                        and self.tokenizer.image is not None else None)
        # Structured output: compiles on its own threads, its tokenizer built on first use.
        self.constraints = ConstraintCompiler(
            GuidanceBackend(self.tokenizer), config.limits.max_constraint_chars,
            config.limits.constraint_compile_timeout_s)
        self.scheduler: Scheduler | None = None
        self.inputs: InputProcessor | None = None
        self.ledger: DeliveryLedger | None = None
        self.admission = Admission(
            config.max_waiting_requests, config.max_waiting_image_bytes,
            lambda: self.scheduler.waiting if self.scheduler is not None else ())

    async def start(self) -> None:
        """Describe the workers, size the caches from them, start the loop."""
        self.model = _model_info(await self.workers.describe(_DESCRIBE_TIMEOUT_S))
        if self.model.block_size != self.config.block_size:
            raise RuntimeError(f"workers use block size {self.model.block_size}, the scheduler "
                               f"{self.config.block_size}: configure both the same")
        c = self.config
        _check_tokenizer(self.tokenizer, self.model, c.model)
        images = c.image_processor(self._images or ImageProcessorConfig(
            patch_size=self.model.patch_size, merge_size=self.model.merge_size))
        max_tokens = min(self.model.num_kv_blocks * c.block_size, self.model.max_seq_len)
        self.inputs = InputProcessor(c.limits, images, max_tokens, self.tokenizer,
                                     self.model.vocab_size, self.constraints)
        self.ledger = DeliveryLedger(self.cache, self.inputs.process, self._offload,
                                     self._redelivered, self.reuse)
        self._reset_state()
        self._spawn(self._run(), "engine-loop")
        self._set_serving(True)
        self._spawn(self._watch_workers(), "worker-watch")

    def _reset_state(self) -> None:
        """Fresh KV and encoder bookkeeping: the workers' caches are empty (start, restart)."""
        assert self.model is not None and self.ledger is not None
        c = self.config
        kv = KVCacheManager(self.model.num_kv_blocks, c.block_size, c.enable_prefix_caching)
        limits = SchedulerLimits(c.max_num_seqs, c.max_num_batched_tokens,
                                 c.max_num_batched_tokens)
        self.scheduler = Scheduler(limits, kv, EncoderCacheManager(c.encoder_cache_embeds),
                                   self.ledger.deliverable, self.counters)

    async def generate(
        self, msg: generate_pb2.GenerateRequest, trace: RequestTrace | None = None
    ) -> AsyncIterator[tuple[Request, StepOutput]]:
        """Validate and enqueue ``msg``; yield (request, output) per step until it finishes.

        Leaving the iteration early (the client cancelled or its deadline passed) aborts
        the request and releases everything it holds. ``trace`` (tracing on) gets the
        request's image spans and scheduling events.
        """
        if not self.serving or self.inputs is None or self.ledger is None:
            raise Unavailable("the cell is not serving: its workers are not ready")
        request = await self._admit(msg, trace)
        assert self.scheduler is not None  # _claim returns only while serving
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

    async def _admit(self, msg: generate_pb2.GenerateRequest,
                     trace: RequestTrace | None) -> Request:
        """``msg`` as a Request holding its images and its id (:meth:`_claim`), within the
        admission bound (checked before its images are looked at, then with their size
        before any is acquired). Refused or failed, it holds nothing. It counts as arriving
        until this returns (waiting for its id included), and the caller queues it before
        its next await: no other request ever sees it uncounted."""
        assert self.inputs is not None and self.ledger is not None
        with self.admission.arrival() as arrival:
            request = await self.inputs.to_request(msg, self._offload, trace)
            arrival.hold(request.image_bytes)
            try:
                await self.ledger.acquire(request)
            except ShmError as exc:  # the store refused the ledger: our bug, not the input
                log.error("acquiring the images of %s failed", request.request_id, exc_info=exc)
                raise _internal() from exc
            try:
                await self._claim(request.request_id)
            except BaseException:
                self.ledger.release(request)
                raise
        return request

    async def _claim(self, request_id: str) -> None:
        """Return once ``request_id`` may be given to a new request, and the cell serves.

        An id is free when no live request holds it and no step out carries an earlier
        holder: results are matched to the request a step carried (the scheduler's
        rule), and this keeps an id to one request across every step out besides, so the
        workers, which key requests by id, see the earlier holder's release (it travels
        with the next step, before anything that step admits) ahead of the new one.
        Steps out drain within a step or two (or are abandoned with a lost worker); a
        live holder still there after :data:`_REUSED_ID_GRACE_S` is a concurrent
        duplicate, refused with DUPLICATE_REQUEST_ID.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _REUSED_ID_GRACE_S
        while True:
            if not self.serving or self.scheduler is None:  # lost meanwhile
                raise Unavailable("the cell is not serving: its workers are not ready")
            live = request_id in self.scheduler.requests
            if not live and not any(request_id in step.out.num_scheduled_tokens
                                    for step in self._out):
                return
            left = deadline - loop.time()
            if live and left <= 0:
                raise InvalidInput(f"request_id {request_id!r} is in use by a request that "
                                   "is still running", "DUPLICATE_REQUEST_ID")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ids_changed.wait(), left if live else None)

    def _id_released(self) -> None:
        """Wake the requests waiting in :meth:`_claim`: a request ended, a step out was
        applied or abandoned, or serving changed."""
        self._ids_changed.set()
        self._ids_changed = asyncio.Event()

    def abort(self, request: Request, reason: int = generate_pb2.FINISH_REASON_ABORT) -> None:
        """Stop a request: blocks, encoder entries and the references it holds freed."""
        assert self.scheduler is not None and self.ledger is not None
        self.ledger.release(request)
        self.scheduler.finish(request, reason)
        self._id_released()
        self._wake.set()

    def _fail(self, requests: Sequence[Request], error: BaseException) -> None:
        for request in requests:
            self.abort(request)
            request.outputs.put_nowait(error)

    def _redelivered(self, request: Request, error: BaseException | None) -> None:
        """The ledger finished re-acquiring a preempted request's references."""
        if error is None:
            self._wake.set()
            return
        log.error("re-delivering request %s failed", request.request_id, exc_info=error)
        if not request.is_finished:
            self._fail([request], _internal())

    async def _offload(self, fn: Callable[[], T]) -> T:
        """Run CPU-heavy image work (checks, hashing, decoding) in the image threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            try:
                await self._iterate()
            except Exception:
                self.errors += 1
                log.exception("unexpected error in the engine loop: failing every request")
                if not self._recover():
                    return
                # The abandoned steps' streams ended as after a loss: settle their doubts
                # as _reconnect does (the workers are all still there), before the loop
                # opens new streams, which the workers' Acknowledge waits out.
                try:
                    await self._settle_unseen([])
                except Exception:
                    log.exception("settling the references in doubt after the error failed; "
                                  "they wait for the next step")

    async def _iterate(self) -> None:
        assert self.scheduler is not None and self.ledger is not None
        if self._lost or not self.serving:
            self._deliver()
        if self._lost:
            ranks, self._lost = tuple(self._lost), []
            if self.serving:  # else a failed step noticed first
                self._lose_workers(ranks, "health stream ended", self._abandon())
        if (self.serving and self.scheduler.has_work and len(self._out) < self._depth):
            out = self.scheduler.schedule()
            for request in out.preempted:
                if not request.is_finished:  # else it ended since it was preempted
                    self.ledger.redeliver(request)
            if not out.is_empty:
                await self._send(out)
                if len(self._out) < self._depth:
                    return  # room for one more step before waiting for the oldest
            elif not self._out:
                self._deliver()
                self._wake.clear()
                await asyncio.sleep(0.01)  # nothing fits now; retry after others change
                self._wake.set()
                return
        if self._out:
            await self._complete_oldest()
            return
        self._deliver()
        self._wake.clear()

    async def _send(self, out: SchedulerOutput) -> None:
        """Build the step message and write it to every worker; then hand the outputs
        applied before it to their streams (their client writes no longer delay a step)."""
        assert self.scheduler is not None and self.model is not None and self.ledger is not None
        self._step_id += 1
        step_id = self._step_id
        segment, generation = self._segment()
        msg, stripped = build_step_request(out, step_id, segment, generation,
                                           self.model.uses_mrope)
        if tracing.enabled():
            msg.trace_context.update(step_trace_context(out, stripped, self.config.block_size))
        self.ledger.sent(step_id, [new.request for new in out.new_requests])
        try:
            sent = await self.workers.send(msg)
        except BaseException:  # written to some workers or none: abandoned with the others
            self._out.append(_Out(out, SentStep(step_id, [])))
            raise
        self._out.append(_Out(out, sent))
        self._deliver()

    async def _complete_oldest(self) -> None:
        """Wait for the oldest step out and apply its results (or its failure)."""
        assert self.scheduler is not None and self.ledger is not None
        step = self._out[0]
        try:
            result = await self.workers.result(step.sent, self.config.step_timeout_s)
        except StepFailed as exc:
            self._out.popleft()
            self._id_released()
            self.ledger.step_done(step.sent.step_id, exc.ranks)
            await self._step_failed(step, exc)
            if self._debug_invariants:  # a failed step too: its references are in doubt
                self.check_invariants()
            return
        self._out.popleft()
        self._id_released()
        self.ledger.step_done(step.sent.step_id)
        for request, output in self.scheduler.update(step.out, result.sampled,
                                                     result.logprobs):
            if output.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
                self.ledger.release(request)  # nothing held normally; the rule is uniform
            self._undelivered.append((request, output))
        if self._out and self._out[0].out.deferred_masks:  # the next step waits for them
            await self.workers.send_masks(self._out[0].sent.step_id,
                                          self.scheduler.deferred_masks(self._out[0].out))
        if step.out.token_masks or step.out.deferred_masks:  # all its masks were computed
            self.mask_time.observe(step.out.mask_seconds)
        if self._out:  # the workers are busy with the next step: no reason to wait
            self._deliver()
        if self._debug_invariants:
            self.check_invariants()
            self.invariant_checks += 1
        self._failed_since_success = False

    def _abandon(self) -> list[SchedulerOutput]:
        """Give up on every step out (a worker is lost, or the loop failed): their outcome
        is unknown on every worker. Returns them, oldest first, for :meth:`_reset`."""
        assert self.ledger is not None
        every = range(len(self.workers.addresses))
        outs = []
        while self._out:
            step = self._out.popleft()
            self.ledger.step_done(step.sent.step_id, every)
            outs.append(step.out)
        self.workers.end_streams()
        self._id_released()
        return outs

    def _deliver(self) -> None:
        """Hand the last step's outputs to their streams, in the order they were sampled."""
        for request, output in self._undelivered:
            request.outputs.put_nowait(output)
        self._undelivered.clear()

    async def _step_failed(self, step: _Out, exc: StepFailed) -> None:
        assert self.scheduler is not None and self.ledger is not None
        if not exc.refused:
            self._lose_workers(exc.ranks, str(exc), [step.out, *self._abandon()])
            return
        # A healthy worker refused the step as invalid: it changed nothing, and only the
        # requests of this step are suspect (a scheduler bug, logged by the worker pool).
        # It ran nothing queued behind it either (worker.proto, Steps): those steps fail
        # as not run, and are undone after it.
        later = list(self._out)
        self._out.clear()
        every = range(len(self.workers.addresses))
        unapplied = True
        for queued in later:
            try:
                await self.workers.result(queued.sent, self.config.step_timeout_s)
            except StepFailed as behind:
                self.ledger.step_done(queued.sent.step_id, behind.ranks)
                unapplied &= behind.not_run and len(behind.ranks) == len(every)
            else:
                self.ledger.step_done(queued.sent.step_id)
                unapplied = False
        self.workers.end_streams()  # the next step starts afresh
        if not unapplied:  # a worker ran a step built on the refused one: state unknown
            self._lose_workers(exc.ranks, "a worker ran a step queued behind a refused one",
                               [step.out, *(q.out for q in later)])
            return
        failed = self.scheduler.refused(step.out, generate_pb2.FINISH_REASON_ABORT)
        for queued in later:
            self.scheduler.unapplied(queued.out)
        log.error("step %d refused by worker(s) %s: failing its %d new requests, "
                  "recomputing %d and %d steps queued behind it", step.sent.step_id, exc.ranks,
                  len(failed), len(step.out.cached_requests), len(later))
        for request in failed:
            self.ledger.release(request)
            request.outputs.put_nowait(_internal())

    def check_invariants(self) -> None:
        """Every bookkeeping structure, whole (after each step with TANDEM_DEBUG_INVARIANTS=1)."""
        assert self.scheduler is not None and self.ledger is not None
        self.scheduler.kv.check_invariants()
        self.scheduler.encoder.check_invariants()
        if isinstance(self.cache, ShmProcessorCache):
            self.cache.writer.check_invariants()
        self.ledger.check_invariants()
        # NOTE: the curve's whole check is O(its 16k stamp slots), tens of milliseconds in
        # Python; it changes only when images are delivered, so it is checked after the
        # steps that follow a delivery rather than after every decode step.
        if self.reuse.references != self._reuse_checked:
            self.reuse.check_invariants()
            self._reuse_checked = self.reuse.references

    def _segment(self) -> tuple[str, int]:
        if isinstance(self.cache, ShmProcessorCache):
            return SEGMENT_FILE, self.cache.writer.generation
        return "", 0

    async def _watch_workers(self) -> None:
        while True:
            await self._serving_again.wait()
            rank = await self.workers.wait_lost()
            self._serving_again.clear()  # until the loss is handled and the cell is back
            self._lost.append(rank)
            self._wake.set()

    def _lose_workers(self, ranks: tuple[int, ...], why: str,
                      outs: Sequence[SchedulerOutput]) -> None:
        """Fail every request with UNAVAILABLE, forget worker state, wait for the workers.

        No reader slot is touched: a worker that timed out may still be running the step
        (the ledger holds its references in doubt); a replaced one is reset on reconnect.
        """
        log.error("worker lost (%s): failing in-flight requests", why)
        self._losses += 1
        self._set_serving(False)
        self._reset(outs, Unavailable(f"worker {ranks[0]} failed; retry the request"))
        self._spawn(self._reconnect(), "worker-reconnect")

    def _reset(self, abandoned: Sequence[SchedulerOutput], error: TandemError) -> None:
        """Fail every request with ``error`` and start the bookkeeping afresh: the one path
        after a lost worker and after an unexpected error.

        The workers (the surviving ones) may still hold what the old bookkeeping knew of,
        so the next step tells them to drop it: every request and encoder output it had,
        and the releases the ``abandoned`` steps carried (finished and preempted ids,
        evicted encoder outputs), which may not have reached them.
        """
        assert self.scheduler is not None
        self._deliver()  # what was applied before goes first
        self._fail(list(self.scheduler.requests.values()), error)
        request_ids, mm_hashes = self.scheduler.leftovers()
        for out in abandoned:
            request_ids += out.finished_request_ids + out.preempted_request_ids
            mm_hashes += out.free_encoder_mm_hashes
        self._reset_state()
        self.scheduler.release_on_workers(request_ids, mm_hashes)

    def _recover(self) -> bool:
        """After an unexpected error: abandon the steps out, fail every request and reset
        the bookkeeping. False when the cell cannot go on: the reset failed, or the error
        came again before any step succeeded since the last one (the scheduler must be
        restarted)."""
        again = self._failed_since_success
        self._failed_since_success = True
        try:
            self._reset(self._abandon(), _internal())
        except Exception:
            log.exception("resetting the engine after the error failed")
            again = True
        if not again:
            return True
        log.error("the engine cannot go on: NOT_SERVING until the scheduler is restarted")
        self._broken = True
        self._set_serving(False)
        if self.scheduler is not None:
            for request in list(self.scheduler.requests.values()):
                request.outputs.put_nowait(_internal())
        return False

    async def _reconnect(self) -> None:
        assert self.ledger is not None
        before = list(self.workers.sockets)
        while True:
            try:
                await self.workers.describe(_RECONNECT_TIMEOUT_S)
            except Unavailable:
                await asyncio.sleep(0.2)
                continue
            replaced = self.workers.replaced(before)
            for rank in replaced:
                self.ledger.reader_gone(rank)
            await self._settle_unseen(replaced)
            log.info("workers are back; serving again")
            self._set_serving(True)
            return

    async def _settle_unseen(self, replaced: list[int]) -> None:
        """Settle the references in doubt now, not at the next step: an idle cell would
        report them unacknowledged for as long as it stays idle (and the operator's
        ReferencesLeaking fire). A step stream ended by a loss drops the steps its worker
        had not read yet, so a live worker may never have seen some failed steps: each
        worker that was not replaced is asked to acknowledge those on its own slot (it
        skips the ones it saw), and its answer also says that every step it received is
        done. With no step out, every slot is then quiescent. A worker that does not answer
        leaves the doubt to the next step, as before (it settles what it can then)."""
        assert self.ledger is not None
        ranks = [r for r in range(len(self.workers.addresses)) if r not in replaced]
        unseen = {rank: self.ledger.unseen(rank) for rank in ranks}
        if not any(unseen.values()):
            return
        segment, generation = self._segment()
        try:
            # NOTE: a worker drops an Acknowledge whose deadline passed before it ran.
            await asyncio.gather(*(
                self.workers.acknowledge(rank, segment, generation, steps,
                                         self.config.step_timeout_s)
                for rank, steps in unseen.items()))
        except Unavailable as exc:
            log.warning("references in doubt wait for the next step: %s", exc)
            return
        self.ledger.settle()
        if self._debug_invariants:
            self.check_invariants()

    @property
    def steps_out(self) -> int:
        """Steps sent to the workers whose results are not applied yet."""
        return len(self._out)

    @property
    def worker_losses(self) -> int:
        return self._losses

    def _set_serving(self, serving: bool) -> None:
        serving = serving and not self._broken
        self.serving = serving
        self._id_released()
        if self._on_serving is not None:
            self._spawn(self._on_serving(serving), "health-update")
        if serving:
            self._serving_again.set()
        else:
            self._serving_again.clear()
        self._wake.set()

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        """Run ``coro`` in a task the engine keeps until it ends, and stops in :meth:`stop`."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def ledger_stats(self) -> LedgerStats:
        return self.ledger.stats() if self.ledger is not None else LedgerStats(0, 0, 0, 0)

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
            held = self.ledger.holders() if self.ledger is not None else set()
            msg.requests_in_flight = len(held | set(self.scheduler.requests.values()))
        self._curve_stats(msg)
        return msg

    def _curve_stats(self, msg: generate_pb2.CacheStatsResponse) -> None:
        """The reuse curve's part of CacheStats: points around the current capacity (for
        ``none``, around --mm-cache-size: what that cache would give), the achievable hit
        ratio and the recommended size (docs/cache-sizing.md)."""
        msg.mm_cache_capacity_bytes = self.cache.capacity
        curve = self.reuse
        msg.mm_cache_curve_references = curve.references
        if not curve.references:
            return
        snap = curve.snapshot(capacities_around(self.cache.capacity or self.config.mm_cache_size))
        msg.mm_cache_curve.extend(generate_pb2.CurvePoint(capacity_bytes=p.capacity_bytes,
                                                          hit_ratio=p.hit_ratio)
                                  for p in snap.points)
        msg.mm_cache_achievable_hit_ratio = snap.achievable_hit_ratio
        msg.mm_cache_recommended_bytes = curve.recommend(
            self.config.mm_cache_target_fraction, _UNBOUNDED_BYTES) or 0

    def model_info(self) -> generate_pb2.GetModelInfoResponse:
        """The served model and the request limits (docs/api.md, GetModelInfo)."""
        if self.model is None or self.inputs is None:
            raise Unavailable("the cell is not serving: its workers are not ready")
        c, lim, m = self.config, self.config.limits, self.model
        msg = generate_pb2.GetModelInfoResponse(
            model_id=c.model_names[0], served_model_names=c.model_names,
            model_type=m.model_type,
            max_context_length=self.inputs.max_model_tokens,
            max_prompt_tokens=lim.max_prompt_tokens, max_output_tokens=lim.max_tokens,
            default_max_tokens=lim.default_max_tokens, vocab_size=m.vocab_size,
            eos_token_ids=sorted(self.tokenizer.special.eos_ids),
            has_chat_template=self._has_chat_template,
            tool_call_parser=self._tool_call_parser,
            mm_cache_type=self.cache.kind, prefix_caching=c.enable_prefix_caching)
        if m.image_token_id is not None:
            images = self.inputs.images
            msg.image_limits.CopyFrom(generate_pb2.ImageLimits(
                min_pixels=images.min_pixels, max_pixels=images.max_pixels,
                max_images_per_request=lim.max_images, max_image_bytes=images.max_image_bytes,
                max_input_pixels=images.max_image_pixels))
        return msg

    async def stop(self) -> None:
        """Abort everything in flight, stop every task, release the pool (not the cache)."""
        self._set_serving(False)
        self._deliver()
        if self.scheduler is not None:
            self._fail(list(self.scheduler.requests.values()),
                       Unavailable("the server is shutting down"))
        tasks = list(self._tasks) + (self.ledger.close() if self.ledger is not None else [])
        for task in tasks:
            if task.get_name() != "health-update":  # the last status must still be set
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.constraints.close()


def _model_info(describes: Sequence[worker_pb2.DescribeResponse]) -> ModelInfo:
    first = describes[0]
    cfg = json.loads(first.model_config_json)
    ranks = sorted(d.rank for d in describes)
    if ranks != list(range(len(describes))):
        raise RuntimeError(f"worker ranks {ranks} are not 0..{len(describes) - 1}")
    return ModelInfo(
        name=first.model, model_type=str(cfg.get("model_type", "tandem")),
        uses_mrope=cfg.get("position_scheme") == "mrope",
        patch_size=int(cfg.get("patch_size", 14)), merge_size=int(cfg.get("merge_size", 2)),
        num_kv_blocks=min(d.num_kv_blocks for d in describes), block_size=first.block_size,
        max_seq_len=int(cfg.get("max_seq_len", 1 << 30)), vocab_size=int(cfg["vocab_size"]),
        image_token_id=cfg.get("image_token_id"))


def _check_tokenizer(tokenizer: Tokenizer, model: ModelInfo, model_dir: str) -> None:
    """The scheduler's tokenizer and the workers' model must agree, or ids would be read as
    other tokens (or index past the embedding table)."""
    if tokenizer.vocab_size > model.vocab_size:
        raise InvalidInput(
            f"{model_dir}: the tokenizer has {tokenizer.vocab_size} ids but the model's "
            f"embedding has {model.vocab_size} rows (config.json 'vocab_size')", "BAD_MODEL")
    pad = tokenizer.image.pad_id if tokenizer.image is not None else None
    if pad != model.image_token_id:
        raise InvalidInput(
            f"{model_dir}: the tokenizer's image placeholder id is {pad} but config.json's "
            f"'image_token_id' is {model.image_token_id}", "BAD_MODEL")


def _tool_call_parser(setting: str, tokenizer: Tokenizer) -> str:
    """The tool-call format the OpenAI API reads ("" = none): the setting, or with
    ``auto`` the one the chat template teaches (:func:`detect_parser`)."""
    if setting != "auto":
        return "" if setting == "none" else setting
    template = tokenizer.chat_template
    return (detect_parser(template.source) or "") if template is not None else ""


def _has_chat_template(tokenizer: Tokenizer) -> bool:
    """Whether ``messages`` can be rendered: asked by rendering a one-line conversation.

    NOTE: the Tokenizer interface has no such property; a template that refuses this
    conversation (e.g. one that insists on a system turn) still counts as present.
    """
    try:
        tokenizer.render_chat([ChatMessage("user", (TextPart("hi"),))])
    except InvalidInput as exc:
        return exc.reason != "NO_CHAT_TEMPLATE"  # HFTokenizer's reason for a missing one
    return True
