"""Prefill and decode tokens/s of the worker step next to the bare model on the same inputs.

Three levels, same work:

* ``bare``: the vision encoder on the step's images plus ``model(inputs)`` on the
  ``ModelInputs`` captured from the runner, nothing else;
* ``runner``: ``StepRunner.step`` in this process (validation, batch building, encoder
  cache, sampling);
* ``grpc``: the Step RPC to a worker subprocess over its Unix socket, images delivered as
  SHM address items (the default cache), proto conversion both ways.

The overhead ratio is level time / bare time. Prefill also prints achieved GFLOP/s
(2 x parameters x tokens, attention excluded) and decode the weight bytes streamed per
second, the physical limits those phases approach. Run::

    python bench/worker_step.py --model small --prompt-tokens 512 --batch 8
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.feature_codec import item_to_parts
from tandem.shm import ShmWriter
from tandem.tokenizer import BOS_ID
from tandem.v1 import worker_pb2_grpc
from worker_svc.checkpoint import compute_dtype, load_model, resolve_device
from worker_svc.config import WorkerConfig
from worker_svc.model import ModelInputs, Transformer
from worker_svc.runner import StepRunner
from worker_svc.server import kv_cache_blocks, serve
from worker_svc.step import StepInput, StepOutput
from worker_svc.step_codec import step_output_from_proto, step_to_proto
from worker_svc.synthetic import (
    ScriptedRequest,
    ScriptedScheduler,
    synthetic_image,
    synthetic_prompt,
)

BLOCK_SIZE = 16
SEGMENT = "features.seg"
StepFn = Callable[[StepInput], StepOutput]


class Recorder:
    """Wraps a step function: times every call and remembers the model's last inputs."""

    def __init__(self, step_fn: StepFn) -> None:
        self.step_fn, self.times = step_fn, []

    def __call__(self, step: StepInput) -> StepOutput:
        t0 = time.perf_counter()
        out = self.step_fn(step)
        self.times.append(time.perf_counter() - t0)
        return out


def prefill_requests(args: argparse.Namespace, model: Transformer, tag: str,
                     writer: ShmWriter | None) -> list[ScriptedRequest]:
    """args.reps requests of ~prompt_tokens with two 16x16-patch images, one token each."""
    c = model.config
    images = [(f"img-{i}", synthetic_image(c, 16, 16, seed=i)) for i in range(2)]
    text = "x" * max(1, (args.prompt_tokens - 2 * 64 - 1) // 3)
    tokens, features = synthetic_prompt(c, [text, text, text], images)
    reqs = []
    for r in range(args.reps + 1):  # the first is an untimed warm-up
        sent = features
        if writer is not None:
            sent = [replace(f, data=writer.hit(k) if writer.is_cached(k)
                            else writer.put(k, item_to_parts(item)))
                    for f, (k, item) in zip(features, images, strict=True)]
        reqs.append(ScriptedRequest(f"{tag}-p{r}", tokens, sent, max_new_tokens=1))
    return reqs


def decode_requests(args: argparse.Namespace, tag: str) -> list[ScriptedRequest]:
    tokens = [BOS_ID] + [ord("a") + i % 26 for i in range(63)]
    return [ScriptedRequest(f"{tag}-d{b}", tokens, [], max_new_tokens=args.decode_steps + 1)
            for b in range(args.batch)]


def run_level(args: argparse.Namespace, model: Transformer, tag: str, step_fn: StepFn,
              segment: tuple[str, int] = ("", 0),
              writer: ShmWriter | None = None) -> tuple[float, float]:
    """Median prefill step and median decode step (seconds) through ``step_fn``."""
    sched = ScriptedScheduler(BLOCK_SIZE, *segment)
    rec = Recorder(step_fn)
    for req in prefill_requests(args, model, tag, writer):
        sched.run(rec, [req])
        step_fn(sched.flush())
    prefill = statistics.median(rec.times[1:])
    rec.times.clear()
    sched.run(rec, decode_requests(args, tag))
    step_fn(sched.flush())
    decode = statistics.median(rec.times[2:])  # skip the prefill and the first decode
    return prefill, decode


def bare_level(args: argparse.Namespace, model: Transformer, runner: StepRunner,
               ) -> tuple[float, float]:
    """Times encoder + forward alone on inputs captured from runner steps."""
    captured: list[ModelInputs] = []
    hook = model.register_forward_pre_hook(lambda _m, a: captured.append(a[0]))
    try:
        run_level(_with(args, reps=1), model, "capture", runner.step)
    finally:
        hook.remove()
    prefill_inputs, decode_inputs = captured[1], captured[-1]
    pixels = [synthetic_image(model.config, 16, 16, seed=i)["pixel_values"].data
              for i in range(2)]

    def prefill() -> None:
        for p in pixels:
            model.encode_image(p, 16, 16)
        model(prefill_inputs)

    return _median_time(prefill, args.reps), _median_time(lambda: model(decode_inputs),
                                                          args.decode_steps)


def _with(args: argparse.Namespace, **changes: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def _median_time(fn: Callable[[], object], reps: int) -> float:
    with torch.inference_mode():
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def start_worker(config: WorkerConfig) -> multiprocessing.Process:
    proc = multiprocessing.get_context("spawn").Process(target=serve, args=(config,))
    proc.start()
    with grpc.insecure_channel(f"unix://{config.socket_path}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while stub.Check(health_pb2.HealthCheckRequest(), wait_for_ready=True,
                         timeout=120).status != health_pb2.HealthCheckResponse.SERVING:
            time.sleep(0.1)
    return proc


def print_environment(model: Transformer, device: torch.device) -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")} or "default"
    load = os.getloadavg()[0]
    print(f"python {platform.python_version()}  torch {torch.__version__}  grpcio "
          f"{grpc.__version__}  threads {torch.get_num_threads()}  device {device}")
    print(f"cpu {cpu}  cores {os.cpu_count()}  load {load:.1f}  malloc {malloc}")
    params = sum(p.numel() for p in model.parameters())
    print(f"model {model.config.dim}d x {model.config.n_layers} layers, "
          f"{params / 1e6:.1f}M parameters\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads here and in the worker (0 = torch's default); "
                        "on a shared machine, oversubscribed OpenMP threads dominate small ops")
    args = parser.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the spawned worker
        torch.set_num_threads(args.threads)

    device = resolve_device(args.device)
    model = load_model(args.model, device, compute_dtype(device))
    shm_dir = tempfile.mkdtemp(prefix="tandem-bench-")
    config = WorkerConfig(model=args.model, shm_dir=shm_dir, device=args.device,
                          block_size=BLOCK_SIZE, kv_cache_bytes=256 << 20)
    model.setup_caches(kv_cache_blocks(config, model.config, device, compute_dtype(device)),
                       BLOCK_SIZE)
    runner = StepRunner(model, receiver=None)
    print_environment(model, device)

    levels = {"bare": bare_level(args, model, runner),
              "runner": run_level(args, model, "runner", runner.step)}
    proc = start_worker(config)
    try:
        with grpc.insecure_channel(f"unix://{config.socket_path}") as ch, ShmWriter(
                Path(shm_dir) / SEGMENT, 64 << 20, 1, 16 << 20) as writer:
            stub = worker_pb2_grpc.WorkerStub(ch)

            def grpc_step(s: StepInput) -> StepOutput:
                return step_output_from_proto(stub.Step(step_to_proto(s), timeout=600))

            levels["grpc"] = run_level(args, model, "grpc", grpc_step,
                                       (SEGMENT, writer.generation), writer)
    finally:
        proc.terminate()
        proc.join(30)
    report(args, model, levels)


def report(args: argparse.Namespace, model: Transformer,
           levels: dict[str, tuple[float, float]]) -> None:
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    prompt = len(prefill_requests(_with(args, reps=0), model, "n", None)[0].token_ids)
    bare_p, bare_d = levels["bare"]
    print(f"{'level':8}{'prefill ms':>12}{'tok/s':>10}{'GFLOP/s':>10}{'x bare':>8}"
          f"{'decode ms':>12}{'tok/s':>10}{'GB/s':>8}{'x bare':>8}")
    for name, (p, d) in levels.items():
        print(f"{name:8}{p * 1e3:12.1f}{prompt / p:10.0f}{2 * params * prompt / p / 1e9:10.1f}"
              f"{p / bare_p:8.2f}{d * 1e3:12.2f}{args.batch / d:10.0f}"
              f"{weight_bytes / d / 1e9:8.2f}{d / bare_d:8.2f}")
    print(f"\nprefill: one step of {prompt} tokens with 2 images (encoder included); "
          f"decode: {args.batch} requests, one token each per step")


if __name__ == "__main__":
    main()
