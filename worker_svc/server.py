"""The worker process: ``tandem.v1.Worker`` over gRPC, plus health and reflection.

Lifecycle: ``create_server`` binds the Unix socket (and TCP, and the health-only port, if
configured) and starts serving at once with health NOT_SERVING, while the model loads and
warms up on the step thread; health turns SERVING when the warm-up step succeeded.
``shutdown`` is the one way down. ``serve`` ties both to SIGTERM/SIGINT for the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch
from prometheus_client import CollectorRegistry

from tandem.cpus import usable_cpus
from tandem.errors import InvalidInput, ResourceExhausted, TandemError, Unavailable, reported
from tandem.feature_codec import descriptor_from_proto
from tandem.grpc_server import GrpcServer
from tandem.metrics import MetricsEndpoint, SnapshotCollector
from tandem.receiver_cache import ShmReceiverCache
from tandem.shm import ShmError
from tandem.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.checkpoint import compute_dtype, load_model, resolve_device
from worker_svc.config import WorkerConfig
from worker_svc.cpu_linear import pack_linears
from worker_svc.model_config import ModelConfig
from worker_svc.runner import StepRunner
from worker_svc.step import DeferredMasks, StepInput, StepOutput
from worker_svc.step_codec import step_from_proto, step_output_to_proto
from worker_svc.step_telemetry import StepTelemetry
from worker_svc.tensor_parallel import GroupLost, join_group, leave_group, rank_device
from worker_svc.thread_team import ThreadTeam

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# A step may carry several inline images of up to --mm-cache-max-object-size each; this
# matches the scheduler's send limit. Responses are a few tokens per request.
MAX_RECEIVE_BYTES = 1 << 30
MAX_SEND_BYTES = 16 << 20


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Describe, Step, Steps and Acknowledge. A thin adapter over :class:`StepRunner`.

    Steps run one at a time on a single worker thread, so the event loop keeps answering
    health checks during a step. Errors are mapped to statuses by the server's
    ``ErrorMappingInterceptor``, never here.
    """

    def __init__(self, config: WorkerConfig, executor: ThreadPoolExecutor,
                 team: ThreadTeam) -> None:
        self.config = config
        self.executor = executor
        self.team = team  # the step thread's torch threads, resized between steps
        self.ready = asyncio.Event()  # set once the model is loaded and warmed up
        self.runner: StepRunner | None = None
        self.describe = worker_pb2.DescribeResponse()
        self.telemetry = StepTelemetry(config.rank)
        # Called when this rank's tensor-parallel group broke; ``serve`` stops the process.
        self.on_group_lost: Callable[[], None] = lambda: None
        self._step_calls = 0  # Step calls and Steps streams in flight
        self._no_step_calls = asyncio.Event()
        self._no_step_calls.set()
        # (segment generation, step id) of the last step handled, written on the step
        # thread only (one assignment: Describe reads it from the event loop).
        self._last_step = (0, 0)

    def load(self) -> None:
        """Load the model, size the KV cache, warm up (runs on the step thread)."""
        c = self.config
        tp = c.tensor_parallel_size
        device = rank_device(resolve_device(c.device), c.rank, tp)
        dtype = compute_dtype(device, c.dtype)
        group = join_group(c, device) if tp > 1 else None  # blocks until the peers arrive
        model = load_model(c.model, device, dtype, c.rank % tp, tp)
        log.info("worker %d: %d linear layers prepacked for the CPU's GEMM", c.rank,
                 pack_linears(model))  # before the TP hooks attach to the layers
        if group is not None:
            group.all_reduce_outputs(model)
        model.setup_caches(kv_cache_blocks(c, model.config, device, dtype), c.block_size)
        if model.decoder is not None:
            log.info("worker %d: the decoder's layers in one call (cpu_decoder.c)", c.rank)
        runner = StepRunner(model, ShmReceiverCache(c.shm_dir, c.rank, device),
                            debug_invariants=os.environ.get("TANDEM_DEBUG_INVARIANTS") == "1",
                            tp=group)
        runner.warm_up()
        self.describe = worker_pb2.DescribeResponse(
            model=c.model, model_config_json=model.config.to_json(),
            device=str(model.output.weight.device), dtype=str(dtype).removeprefix("torch."),
            num_kv_blocks=model.num_blocks, block_size=model.block_size,
            rank=c.rank, world_size=c.world_size)
        self.runner = runner

    async def Describe(self, request: worker_pb2.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.DescribeResponse:
        await self.ready.wait()  # the caller's deadline bounds the wait for warm-up
        assert self.runner is not None and self.runner.receiver is not None
        out = worker_pb2.DescribeResponse()
        out.CopyFrom(self.describe)
        out.segment_generation = self.runner.receiver.generation
        out.last_step_generation, out.last_step_id = self._last_step
        return out

    async def Step(self, request: worker_pb2.StepRequest,
                   context: grpc.aio.ServicerContext) -> worker_pb2.StepResponse:
        return await self._run(request)

    async def Steps(self, requests: AsyncIterator[worker_pb2.StepsRequest],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.StepsResponse]:
        """The scheduler's step stream. Each step is decoded here and queued on the one
        step thread as soon as it arrives, so the thread goes from one step to the next
        without waiting for this loop, and the protobuf work of both directions happens
        here while the thread runs a step; answers go back in order. A failed step is
        answered with its error, the status Step would end with; every later one with
        ``not_run``: the scheduler built them on the failed step's effects (worker.proto).
        Steps still queued when the stream ends do not run. A step not run still has its
        address items acknowledged (:meth:`_skip`). Only a broken tensor-parallel group
        ends the stream itself (and the process)."""
        loop = asyncio.get_running_loop()
        stream = _StreamState()
        queued: asyncio.Queue[tuple[int, asyncio.Future[StepOutput | worker_pb2.StepsResponse]]
                              | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for request in requests:
                    if request.HasField("masks"):
                        stream.deliver(request.masks)
                        continue
                    step_id = request.step.step_id
                    try:
                        self._check_ready()
                        step: StepInput | Exception = step_from_proto(request.step)
                    except Exception as exc:  # answered in its turn, as the thread would
                        step = exc
                    if not isinstance(step, Exception) and step.deferred_masks is not None:
                        stream.deferred[step_id] = step.deferred_masks
                    queued.put_nowait((step_id, loop.run_in_executor(
                        self.executor, self._stream_step, request.step.segment_generation,
                        step_id, step, stream)))
            finally:
                stream.cancel_deferred()  # no masks can come any more
                queued.put_nowait(None)

        reader = asyncio.create_task(read(), name="steps-reader")
        self._step_call_began()
        try:
            while (item := await queued.get()) is not None:
                step_id, answer = item
                try:
                    out = await answer
                except GroupLost:
                    self._group_lost()
                    raise
                yield out if isinstance(out, worker_pb2.StepsResponse) else (
                    worker_pb2.StepsResponse(step_id=step_id, done=step_output_to_proto(out)))
        finally:
            stream.ended = True
            stream.cancel_deferred()
            reader.cancel()
            self._step_call_ended()

    def _step_call_began(self) -> None:
        self._step_calls += 1
        self._no_step_calls.clear()

    def _step_call_ended(self) -> None:
        self._step_calls -= 1
        if not self._step_calls:
            self._no_step_calls.set()

    async def step_calls_ended(self) -> None:
        """Returns once no Step call or Steps stream is in flight (no scheduler attached)."""
        await self._no_step_calls.wait()

    def _stream_step(self, generation: int, step_id: int, step: StepInput | Exception,
                     stream: _StreamState) -> StepOutput | worker_pb2.StepsResponse:
        """One step of a Steps stream, on the step thread: its output, or the answer that
        it failed (``step`` is the error when it could not be decoded) or did not run."""
        self._last_step = (generation, step_id)  # taken up, whatever its outcome
        if stream.failed or stream.ended:
            if not isinstance(step, Exception):
                self._skip(step)
            return worker_pb2.StepsResponse(step_id=step_id, not_run=True)
        try:
            if isinstance(step, Exception):
                raise step
            return self._run_step(step)
        except GroupLost:
            raise
        except Exception as exc:
            stream.failed = True
            err = reported(exc)
            return worker_pb2.StepsResponse(step_id=step_id, error=worker_pb2.StepError(
                code=err.code.value[0], message=err.message, reason=err.reason))

    def _skip(self, step: StepInput) -> None:
        """A step answered ``not_run`` acknowledges its address items (``StepRunner.skip``);
        when they fail the checks it stays not run, and the scheduler's doubt stays."""
        assert self.runner is not None  # a decoded step passed _check_ready
        try:
            if acked := self.runner.skip(step):
                log.info("step %d was not run; its %d address items are acknowledged",
                         step.step_id, acked)
        except (TandemError, ShmError) as exc:
            log.warning("step %d was not run and its address items were not acknowledged: "
                        "%s", step.step_id, exc)

    async def Acknowledge(self, request: worker_pb2.AcknowledgeRequest,
                          context: grpc.aio.ServicerContext) -> worker_pb2.AcknowledgeResponse:
        """Acknowledge the address items of steps that never reached this worker
        (worker.proto). Why wait for the step calls to end: a step of an ended stream
        still queued here is handled (and acknowledged) in its turn; once no stream is
        open none can be added, so the step thread, which runs this after them, knows
        from :attr:`_last_step` which of the steps it was asked about it has seen."""
        self._check_ready()
        await self._no_step_calls.wait()  # the caller's deadline bounds the wait
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, self._acknowledge, request)

    def _acknowledge(self, request: worker_pb2.AcknowledgeRequest
                     ) -> worker_pb2.AcknowledgeResponse:
        """On the step thread: acknowledge the steps after the last one handled."""
        assert self.runner is not None
        generation, last = self._last_step
        if generation != request.segment_generation:
            last = 0  # step ids restart with a new scheduler (and generation)
        unseen = [s for s in request.steps if s.step_id > last]
        acked = self.runner.acknowledge_unseen(
            request.segment_name, request.segment_generation,
            [descriptor_from_proto(a) for s in unseen for a in s.items])
        if unseen:
            last = max(s.step_id for s in unseen)
            self._last_step = (request.segment_generation, last)
            log.info("steps %s never reached this worker; their %d address items are "
                     "acknowledged", [s.step_id for s in unseen], acked)
        return worker_pb2.AcknowledgeResponse(acked=acked, last_step_id=last)

    def _check_ready(self) -> None:
        """Checked before a step is queued: the step thread is busy loading until then."""
        if not self.ready.is_set():
            raise Unavailable("the worker is still warming up", reason="WARMING_UP")

    async def _run(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        self._check_ready()
        loop = asyncio.get_running_loop()
        self._step_call_began()
        try:
            return await loop.run_in_executor(self.executor, self._step, request)
        except GroupLost:
            self._group_lost()
            raise
        finally:
            self._step_call_ended()

    def _group_lost(self) -> None:
        log.error("worker %d lost its tensor-parallel group; stopping", self.config.rank)
        self.on_group_lost()

    def _step(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        self._last_step = (request.segment_generation, request.step_id)
        if request.deferred_mask_ids:
            raise InvalidInput("deferred token masks come on the Steps stream only",
                               reason="BAD_TOKEN_MASK")
        return step_output_to_proto(self._run_step(step_from_proto(request)))

    def _run_step(self, step: StepInput) -> StepOutput:
        """Run one step (on the step thread), then let the torch team follow the CPUs."""
        assert self.runner is not None
        started = time.monotonic()
        try:
            return self.telemetry.run(step, self.runner.step)
        finally:
            self.team.after_step(time.monotonic() - started, (
                step.total_num_scheduled_tokens, len(step.num_scheduled_tokens)))

    def close(self) -> None:
        if self.runner is not None and self.runner.receiver is not None:
            self.runner.receiver.close()
        leave_group()


@dataclass
class _StreamState:
    """One Steps stream, as its steps see it on the step thread."""

    failed: bool = False  # a step failed: the later ones are not run
    ended: bool = False  # the stream is gone: steps still queued are not run
    # step id -> the masks it waits for (only the reader, on the event loop, touches it)
    deferred: dict[int, DeferredMasks] = field(default_factory=dict)

    def deliver(self, msg: worker_pb2.StepMasks) -> None:
        """The deferred masks of a step sent earlier; for one that is not waiting (it
        failed to decode), nothing."""
        waiting = self.deferred.pop(msg.step_id, None)
        if waiting is None:
            log.warning("token masks for step %d, which awaits none", msg.step_id)
            return
        waiting.deliver(dict(msg.token_masks))

    def cancel_deferred(self) -> None:
        for waiting in self.deferred.values():
            waiting.cancel()
        self.deferred.clear()


def kv_cache_blocks(config: WorkerConfig, model_config: ModelConfig, device: torch.device,
                    dtype: torch.dtype) -> int:
    """Blocks that fit the budget: bytes on CPU, a fraction of free memory on CUDA."""
    per_block = (model_config.kv_bytes_per_block(config.block_size, dtype.itemsize)
                 // config.tensor_parallel_size)  # each rank holds its KV heads only
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_fraction)
    else:
        budget = config.kv_cache_bytes
    if budget // per_block < 2:
        raise ResourceExhausted(f"the KV budget of {budget} bytes holds fewer than 2 blocks of "
                                f"{per_block} bytes", reason="KV_BUDGET_TOO_SMALL")
    return budget // per_block


@dataclass
class RunningWorker:
    """A started worker server: what ``shutdown`` needs, and the addresses for clients."""

    config: WorkerConfig
    grpc: GrpcServer  # its health-only port (for kubelet probes) never serves Step
    addresses: list[str]  # "unix:///abs/path/worker-<rank>.sock", then "host:port" if TCP
    servicer: WorkerServicer
    executor: ThreadPoolExecutor
    warmup: asyncio.Task[None]
    metrics: MetricsEndpoint | None = None


def set_thread_budget(config: WorkerConfig) -> int:
    """torch's threads for this worker: ``config.threads``, else every CPU it may use
    (:func:`tandem.cpus.usable_cpus`: the affinity capped by the container's CPU quota,
    which torch's own default ignores)."""
    threads = config.threads or usable_cpus()
    torch.set_num_threads(threads)
    return threads


async def create_server(config: WorkerConfig) -> RunningWorker:
    """Start serving now (health NOT_SERVING); load and warm up in the background."""
    threads = set_thread_budget(config)
    team = ThreadTeam(threads, config.adapt_threads, rank=config.rank)
    log.info("worker %d: %d torch threads%s", config.rank, threads,
             ", fewer while they wait for CPUs" if team.adaptive else "")
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-step")
    servicer = WorkerServicer(config, executor, team)
    server = GrpcServer.create(SERVICE_NAME, [
        ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
        ("grpc.max_send_message_length", MAX_SEND_BYTES)], trace_calls=False)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server.server)
    addresses = await server.start(lambda s: _bind(s, config), config.health_listen,
                                   overall_serving=False)
    warmup = asyncio.create_task(_warm_up(servicer, server), name="worker-warmup")
    metrics = None
    if config.metrics_port:
        registry = CollectorRegistry()
        registry.register(SnapshotCollector(servicer.telemetry.metric_values))
        registry.register(SnapshotCollector(servicer.team.metric_values))
        registry.register(servicer.telemetry.mask_wait)
        metrics = await MetricsEndpoint.start(registry, config.metrics_port)
    return RunningWorker(config, server, addresses, servicer, executor, warmup, metrics)


def _bind(server: grpc.aio.Server, config: WorkerConfig) -> list[str]:
    """The Unix socket, created 0600 (umask while binding), then TCP if configured."""
    path = config.socket_path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # left by a worker that died; the rank is ours
    old_umask = os.umask(0o177)
    try:
        server.add_insecure_port(f"unix://{path}")
    finally:
        os.umask(old_umask)
    addresses = [f"unix://{path}"]
    if config.worker_listen:
        host = config.worker_listen.rsplit(":", 1)[0]
        port = server.add_insecure_port(config.worker_listen)
        addresses.append(f"{host}:{port}")
    return addresses


async def _warm_up(servicer: WorkerServicer, server: GrpcServer) -> None:
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(servicer.executor, servicer.load)
    servicer.ready.set()
    await server.set_serving(True, overall=True)
    log.info("worker %d ready: %s", servicer.config.rank, servicer.describe.device)


async def shutdown(worker: RunningWorker) -> None:
    """Stop a worker in order, within its ``shutdown_grace_s`` (the grace) and then some.

    While a scheduler keeps a Steps stream open (or a Step call runs), serve on as before,
    health SERVING, for up to the grace: a scheduler stopping at the same time (Kubernetes
    stops a cell's pods together) still runs its streams' last steps here, and closes its
    streams when done; a NOT_SERVING worker would count as lost to it and fail them all.
    Then health NOT_SERVING -> ``server.stop(0)`` (what is still open is no step: health
    watches, a Describe) -> close the health port -> cancel a warm-up still running -> join
    the step thread -> detach from the segment -> remove the socket -> stop serving
    metrics. The segment itself belongs to the scheduler and is left alone.
    """
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(worker.servicer.step_calls_ended(),
                               worker.config.shutdown_grace_s)
    await worker.grpc.stop(0)
    worker.warmup.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await worker.warmup
    await asyncio.to_thread(worker.executor.shutdown, wait=True, cancel_futures=True)
    worker.servicer.close()
    worker.config.socket_path.unlink(missing_ok=True)
    if worker.metrics is not None:
        await worker.metrics.close()


def serve(config: WorkerConfig) -> None:
    """Run a worker until SIGTERM or SIGINT (an ignored SIGINT stays ignored)."""
    asyncio.run(_serve(config))


async def _serve(config: WorkerConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            loop.add_signal_handler(sig, stop.set)
    worker = await create_server(config)
    worker.servicer.on_group_lost = stop.set  # a restarted process re-forms the group
    log.info("worker %d listening on %s%s", config.rank, ", ".join(worker.addresses),
             f", health only on port {worker.grpc.probes.port}" if worker.grpc.probes else "")
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({worker.warmup, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if worker.warmup.done() and not worker.warmup.cancelled():
            worker.warmup.result()  # a model that failed to load ends the process here
        await stopping
    finally:
        stopping.cancel()
        await shutdown(worker)
