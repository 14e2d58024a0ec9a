"""Where a serving step's time goes, at 1, 4 and 16 decode streams, next to the bare model.

One run per model (``small``, ``tiny``): a real worker subprocess and a real scheduler
subprocess (the same ``serve`` functions ``tandem serve`` runs), clients here streaming
``Generate`` over gRPC. Both services run with timing hooks this script installs on the
real code paths before serving, and write one JSON line per step:

* scheduler: ``Scheduler.schedule`` (scheduling), ``build_step_request`` (the step
  message), ``WorkerPool.result`` (the loop waiting for the oldest step's answer),
  ``Scheduler.update`` (applying results, detokenizing included), ``to_response`` (the
  GenerateResponse), and every event-loop callback's run time (``asyncio.Handle._run``):
  the loop's busy time less the parts above is streaming to clients (the servicers'
  generators and gRPC's own callbacks);
* worker: ``WorkerServicer._run_step`` (the whole step on the step thread; on the Steps
  stream the proto conversion happens on the worker's event loop meanwhile),
  ``Transformer.forward`` (the model forward; synchronised on CUDA) and
  ``StepRunner._sample``; the rest of ``_step`` is the worker's bookkeeping, and the time
  between the end of one step and the end of the next less the step itself is the
  worker's idle time: what the scheduler costs the model.

The breakdown is the median over the decode steps whose batch is exactly the stream count
(no prefill in the step). The bound is the bare model: ``model(inputs)`` on a decode batch of
the same size captured from a ``StepRunner`` in this process, nothing else; the ratio is
end-to-end output tokens/s (what the clients received, ramp-up included) over the bare
batched decode rate, printed next to issue 18's target. Each model runs two cells at once,
asynchronous scheduling off and on (``--async-scheduling``), the rounds (and the TTFT
requests) taking turns between them. Run::

    python bench/step_overhead.py                  # small and tiny, 1/4/16 streams
    python bench/step_overhead.py --models tiny --rounds 1 --tokens 32   # quick look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import grpc
import torch

from tandem.text.byte_tokenizer import BOS_ID
from tandem.v1 import generate_pb2_grpc
from tandem_testing.cells import free_port, request
from tandem_testing.environment import environment_lines
from tandem_testing.scripted import ScriptedRequest, ScriptedScheduler

BLOCK_SIZE = 16
KV_BYTES = 256 << 20
TARGETS = {"small": 0.85, "tiny": 0.6}  # issue 18, at 16 streams
PROMPT = "Client {i} writes a story about the sea:"


class StepClock:
    """Per-step time accumulators of one process, written as one JSON line per step.

    ``add`` is called by the hooks; ``boundary`` closes the record of the previous step and
    opens the next one, its length under ``period_key``. Only the thread that runs the
    hooked code calls it (the event loop in the scheduler, the step thread in the worker),
    so no lock is needed.
    """

    def __init__(self, path: Path, period_key: str = "period") -> None:
        self.out: TextIO = path.open("a", buffering=1)
        self.record: dict[str, Any] = {}
        self.started = 0.0
        self.period_key = period_key

    def add(self, key: str, seconds: float) -> None:
        self.record[key] = self.record.get(key, 0.0) + seconds

    def boundary(self, now: float) -> None:
        if "step_id" in self.record:
            self.record[self.period_key] = now - self.started
            self.out.write(json.dumps(self.record) + "\n")
        self.record, self.started = {}, now


def timed(clock: StepClock, owner: Any, name: str, key: str) -> None:
    """Replace ``owner.name`` (a function or method) with one that adds its wall time."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            clock.add(key, time.perf_counter() - t0)

    setattr(owner, name, wrapper)


def timed_async(clock: StepClock, owner: Any, name: str, key: str) -> None:
    original = getattr(owner, name)

    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await original(*args, **kwargs)
        finally:
            clock.add(key, time.perf_counter() - t0)

    setattr(owner, name, wrapper)


def run_scheduler(config: Any, records: Path) -> None:
    """Subprocess: the scheduler's ``serve`` with the scheduler-side hooks."""
    from scheduler_svc import engine, scheduler, server, servicer, worker_client

    clock = StepClock(records)
    sched_cls = scheduler.Scheduler
    schedule = sched_cls.schedule

    def timed_schedule(self: Any) -> Any:
        t0 = time.perf_counter()
        clock.boundary(t0)
        out = schedule(self)
        clock.add("schedule", time.perf_counter() - t0)
        clock.record["new"] = len(out.new_requests)
        clock.record["running"] = len(out.new_requests) + len(out.cached_requests)
        return out

    sched_cls.schedule = timed_schedule
    build = engine.build_step_request

    def timed_build(out: Any, step_id: int, *args: Any) -> Any:
        t0 = time.perf_counter()
        msg = build(out, step_id, *args)
        clock.add("message", time.perf_counter() - t0)
        clock.record["step_id"] = step_id
        return msg

    engine.build_step_request = timed_build
    timed_async(clock, worker_client.WorkerPool, "result", "wait")
    timed(clock, sched_cls, "update", "apply")
    timed(clock, servicer, "to_response", "response")
    timed(clock, asyncio.events.Handle, "_run", "loop_busy")
    asyncio.run(server.serve(config))


def run_worker(config: Any, records: Path) -> None:
    """Subprocess: the worker's ``serve`` with the worker-side hooks."""
    from worker_svc import model, runner, server

    clock = StepClock(records, "worker_period")
    step = server.WorkerServicer._run_step

    def timed_step(self: Any, msg: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return step(self, msg)
        finally:
            clock.add("worker", time.perf_counter() - t0)
            clock.record["step_id"] = msg.step_id
            clock.boundary(time.perf_counter())

    server.WorkerServicer._run_step = timed_step
    forward = model.Transformer.forward

    def timed_forward(self: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        logits = forward(self, *args)
        if logits.is_cuda:
            torch.cuda.synchronize()
        clock.add("forward", time.perf_counter() - t0)
        return logits

    model.Transformer.forward = timed_forward
    timed(clock, runner.StepRunner, "_sample", "sample")
    server.serve(config)


@dataclass
class Cell:
    """The two service processes of one model and the files their hooks write."""

    scheduler: multiprocessing.process.BaseProcess
    worker: multiprocessing.process.BaseProcess
    target: str
    stub: generate_pb2_grpc.GenerationStub
    channel: grpc.Channel
    sched_records: Path
    worker_records: Path


def start_cell(model: str, device: str, tmp: Path, async_scheduling: bool) -> Cell:
    from scheduler_svc.config import SchedulerConfig
    from worker_svc.config import WorkerConfig

    ctx = multiprocessing.get_context("spawn")  # grpc and fork don't mix
    wconf = WorkerConfig(model=model, shm_dir=str(tmp), device=device, block_size=BLOCK_SIZE,
                         kv_cache_bytes=KV_BYTES)
    worker = ctx.Process(target=run_worker, args=(wconf, tmp / "worker.jsonl"))
    worker.start()
    port = free_port()
    sconf = SchedulerConfig(model=model, listen=f"127.0.0.1:{port}", shm_dir=str(tmp),
                            block_size=BLOCK_SIZE,
                            worker_addresses=(f"unix://{wconf.socket_path}",),
                            step_timeout_s=600.0, async_scheduling=async_scheduling)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    cell = Cell(ctx.Process(target=run_scheduler, args=(sconf, tmp / "scheduler.jsonl")),
                worker, f"127.0.0.1:{port}", generate_pb2_grpc.GenerationStub(channel), channel,
                tmp / "scheduler.jsonl", tmp / "worker.jsonl")
    # The scheduler describes the worker once at start: start it after the worker serves.
    deadline = time.monotonic() + 300
    while not wconf.socket_path.exists():
        if time.monotonic() > deadline or not worker.is_alive():
            raise RuntimeError("the worker did not start")
        time.sleep(0.2)
    time.sleep(1.0)
    cell.scheduler.start()
    while True:
        try:
            list(cell.stub.Generate(request("warm up", max_tokens=2), timeout=300,
                                    wait_for_ready=True))
            return cell
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def stop_cell(cell: Cell) -> None:
    cell.channel.close()
    for proc in (cell.scheduler, cell.worker):
        proc.terminate()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def clients(cell: Cell, streams: int, tokens: int) -> float:
    """Output tokens/s that ``streams`` concurrent clients received, each ``tokens`` long.

    The clients are coroutines on one grpc.aio channel in one thread: on a two-core machine
    a thread per client would take CPU from the cell it measures."""

    async def run(stub: generate_pb2_grpc.GenerationStub, i: int) -> int:
        msg = request(PROMPT.format(i=i), max_tokens=tokens, ignore_eos=True)
        return sum([len(m.token_ids) async for m in stub.Generate(msg, timeout=600)])

    async def all_clients() -> tuple[int, float]:
        async with grpc.aio.insecure_channel(cell.target) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            start = time.perf_counter()
            got = await asyncio.gather(*(run(stub, i) for i in range(streams)))
            return sum(got), time.perf_counter() - start

    got, seconds = asyncio.run(all_clients())
    if got != streams * tokens:
        raise RuntimeError(f"clients got {got} tokens, expected {streams * tokens}")
    return got / seconds


def warm_ttft(cells: dict[str, Cell], reps: int = 9) -> dict[str, float]:
    """Per cell, the median time to the first token of a request identical to one just
    served, alone on the cell (its prompt comes from the prefix cache but for the last
    token); the cells take turns."""
    msg = request(PROMPT.format(i="warm"), max_tokens=1)
    times: dict[str, list[float]] = {mode: [] for mode in cells}
    for cell in cells.values():
        list(cell.stub.Generate(msg, timeout=600))
    for _ in range(reps):
        for mode, cell in cells.items():
            t0 = time.perf_counter()
            next(m for m in cell.stub.Generate(msg, timeout=600) if m.token_ids)
            times[mode].append(time.perf_counter() - t0)
    return {mode: statistics.median(t) for mode, t in times.items()}


class Bare:
    """``model(inputs)`` alone on decode batches captured from a ``StepRunner``."""

    def __init__(self, model_name: str, device_spec: str) -> None:
        from worker_svc.checkpoint import compute_dtype, load_model, resolve_device
        from worker_svc.config import WorkerConfig
        from worker_svc.cpu_linear import pack_linears
        from worker_svc.runner import StepRunner
        from worker_svc.server import kv_cache_blocks

        self.device = resolve_device(device_spec)
        dtype = compute_dtype(self.device)
        self.model = load_model(model_name, self.device, dtype)
        pack_linears(self.model)  # as the worker serves it
        config = WorkerConfig(model=model_name, shm_dir="/nonexistent", block_size=BLOCK_SIZE,
                              kv_cache_bytes=KV_BYTES)
        self.model.setup_caches(kv_cache_blocks(config, self.model.config, self.device, dtype),
                                BLOCK_SIZE)
        self.runner = StepRunner(self.model, receiver=None)
        self.inputs: dict[int, Any] = {}

    def capture(self, batch: int) -> Any:
        """Decode inputs of ``batch`` requests with a 40-token prompt (the clients' size)."""
        if batch not in self.inputs:
            captured: list[Any] = []
            hook = self.model.register_forward_pre_hook(lambda _m, a: captured.append(a[0]))
            tokens = [BOS_ID] + [ord("a") + i % 26 for i in range(39)]
            try:
                ScriptedScheduler(BLOCK_SIZE).run(self.runner.step, [
                    ScriptedRequest(f"bare-{batch}-{b}", tokens, [], max_new_tokens=4)
                    for b in range(batch)])
            finally:
                hook.remove()
            self.inputs[batch] = captured[-1]
        return self.inputs[batch]

    @torch.inference_mode()
    def decode_step_s(self, batch: int, reps: int = 30) -> float:
        inputs = self.capture(batch)
        times = []
        for _ in range(reps + 3):
            t0 = time.perf_counter()
            self.model(inputs)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[3:])


def read_records(path: Path, start: int) -> tuple[list[dict[str, Any]], int]:
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines[start:]], len(lines)


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) a process has used: ``pid``'s, or this one's."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Phase:
    """One round at one stream count: what the clients got and the step records."""

    e2e_tps: float
    bare_s: float
    steps: list[dict[str, float]]  # decode steps of the full batch, scheduler + worker keys
    cpu_per_step: tuple[float, float, float]  # s: scheduler, worker, clients (per decode step)


def run_phase(cell: Cell, bare: Bare, streams: int, tokens: int,
              offsets: list[int]) -> Phase:
    pids = (cell.scheduler.pid, cell.worker.pid, None)
    before = [cpu_seconds(p) for p in pids]
    tps = clients(cell, streams, tokens)
    cpu = tuple((cpu_seconds(p) - b) / tokens for p, b in zip(pids, before, strict=True))
    time.sleep(0.3)  # the last step's records reach the files
    sched, offsets[0] = read_records(cell.sched_records, offsets[0])
    work, offsets[1] = read_records(cell.worker_records, offsets[1])
    by_id = {r["step_id"]: r for r in work}
    steps = [{**by_id[r["step_id"]], **r} for r in sched
             if r.get("running") == streams and r.get("new") == 0 and r["step_id"] in by_id]
    return Phase(tps, bare.decode_step_s(streams), steps, cpu)  # type: ignore[arg-type]


COLUMNS = [  # (label, how to compute it from a step record), all in ms
    ("schedule", lambda r: r.get("schedule", 0.0)),
    ("message", lambda r: r.get("message", 0.0)),
    ("wait", lambda r: r.get("wait", 0.0)),
    ("worker idle", lambda r: r["worker_period"] - r["worker"]),
    ("worker bk", lambda r: r["worker"] - r.get("forward", 0.0) - r.get("sample", 0.0)),
    ("forward", lambda r: r.get("forward", 0.0)),
    ("sample", lambda r: r.get("sample", 0.0)),
    ("apply", lambda r: r.get("apply", 0.0)),
    ("response", lambda r: r.get("response", 0.0)),
    ("stream", lambda r: r["loop_busy"] - r.get("schedule", 0.0) - r.get("message", 0.0)
     - r.get("apply", 0.0) - r.get("response", 0.0)),
    ("step", lambda r: r["period"]),
]


def report(model: str, mode: str, phases: dict[int, list[Phase]], ttft_s: float) -> None:
    med = statistics.median
    print(f"\nmodel {model}, asynchronous scheduling {mode}: per decode step, ms (medians "
          "over full-batch decode steps; 'wait' = the scheduler loop waiting for a step's "
          "answer; 'worker idle' = the worker's time between two steps; 'apply' includes "
          "detokenizing; 'stream' = scheduler loop busy time outside the other scheduler "
          "columns; it runs while the loop awaits the workers, so the columns overlap and "
          "do not sum to 'step')")
    print(f"{'streams':>7}" + "".join(f"{label:>11}" for label, _ in COLUMNS)
          + f"{'bare':>9}{'steps':>7}")
    for streams, rounds in phases.items():
        steps = [s for p in rounds for s in p.steps]
        if not steps:
            print(f"{streams:7d}  (no full-batch decode step recorded)")
            continue
        cells = "".join(f"{1e3 * med(fn(s) for s in steps):11.2f}" for _, fn in COLUMNS)
        bare = med(p.bare_s for p in rounds)
        print(f"{streams:7d}{cells}{1e3 * bare:9.2f}{len(steps):7d}")
    print(f"\n{'streams':>7}{'e2e tok/s':>11}{'steady tok/s':>14}{'bare tok/s':>12}"
          f"{'e2e/bare':>10}{'steady/bare':>13}{'target':>8}")
    for streams, rounds in phases.items():
        steps = [s for p in rounds for s in p.steps]
        e2e = med(p.e2e_tps for p in rounds)
        bare = streams / med(p.bare_s for p in rounds)
        ratio = med(p.e2e_tps * p.bare_s / streams for p in rounds)
        steady = streams / med(s["period"] for s in steps) if steps else float("nan")
        target = f"{TARGETS[model]:.2f}" if streams == 16 and model in TARGETS else "-"
        print(f"{streams:7d}{e2e:11.0f}{steady:14.0f}{bare:12.0f}{ratio:10.2f}"
              f"{steady / bare:13.2f}{target:>8}")
    print(f"\n{'streams':>7}  CPU per step, ms: {'scheduler':>9}{'worker':>8}{'clients':>9}"
          f"{'sum':>7}   (the machine has {os.cpu_count()} CPUs)")
    for streams, rounds in phases.items():
        cpu = [med(p.cpu_per_step[i] for p in rounds) * 1e3 for i in range(3)]
        print(f"{streams:7d}{'':18}{cpu[0]:9.2f}{cpu[1]:8.2f}{cpu[2]:9.2f}{sum(cpu):7.2f}")
    print(f"TTFT of a warm identical request, alone: {1e3 * ttft_s:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["small", "tiny"])
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per client")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--async-scheduling", choices=["off", "on", "both"], default="both",
                    help="run the cell with asynchronous scheduling off, on, or each in turn")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads here and in both services (0 = torch's default); on "
                    "a shared machine, oversubscribed OpenMP threads make the forward erratic")
    args = ap.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the spawned services
        torch.set_num_threads(args.threads)
    print("\n".join(environment_lines()))
    print(f"{args.tokens} output tokens per client, {args.rounds} rounds, streams "
          f"{args.streams}, device {args.device}, torch threads {torch.get_num_threads()}")
    modes = ["off", "on"] if args.async_scheduling == "both" else [args.async_scheduling]
    for model in args.models:
        bare = Bare(model, args.device)
        with contextlib.ExitStack() as stack:
            cells = {}
            for mode in modes:  # both up at once: the rounds take turns between them
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="tandem-steps-"))
                cells[mode] = start_cell(model, args.device, Path(tmp), mode == "on")
                stack.callback(stop_cell, cells[mode])
            phases = run_rounds(cells, bare, args)
            ttft_s = warm_ttft(cells)
        for mode in modes:
            report(model, mode, phases[mode], ttft_s[mode])


def run_rounds(cells: dict[str, Cell], bare: Bare,
               args: argparse.Namespace) -> dict[str, dict[int, list[Phase]]]:
    """Per cell and stream count, ``args.rounds`` phases; cells take turns at each count."""
    offsets = {mode: [len(p.read_text().splitlines()) if p.exists() else 0
                      for p in (cell.sched_records, cell.worker_records)]
               for mode, cell in cells.items()}
    for mode, cell in cells.items():
        for s in args.streams:  # warm-up round, dropped
            run_phase(cell, bare, s, min(args.tokens, 16), offsets[mode])
    phases: dict[str, dict[int, list[Phase]]] = {m: {s: [] for s in args.streams}
                                                  for m in cells}
    for _ in range(args.rounds):
        for s in args.streams:
            for mode, cell in cells.items():
                phases[mode][s].append(run_phase(cell, bare, s, args.tokens, offsets[mode]))
    return phases


if __name__ == "__main__":
    main()
