"""Prefill and decode tokens/s of the worker step next to the bare model on the same inputs.

Levels, same work:

* ``bare``: the vision encoder on the step's images plus ``model(inputs)`` on the
  ``ModelInputs`` captured from the runner, nothing else;
* ``runner``: ``StepRunner.step`` in this process (validation, batch building, encoder
  cache, sampling);
* ``grpc``: the Step RPC to a worker subprocess over its Unix socket, images delivered as
  SHM address items (the default cache), proto conversion both ways;
* ``unpacked`` (only when asked): ``bare`` on a second copy of the model whose linear
  layers call ``F.linear`` instead of the CPU's prepacked weights (``cpu_linear.py``);
* ``onednn`` (only when asked): ``bare`` on a second copy of the model in oneDNN's
  blocked layout, where the machine's default is the column panels of ``cpu_gemm.c``;
* ``gathered`` (only when asked): ``bare`` on a second copy of the model whose decode
  attention gathers each context and calls SDPA instead of the CPU kernel that reads the
  cache in place (``cpu_attention.py``).

The overhead ratio is level time / bare time. Prefill also prints achieved GFLOP/s
(2 x parameters x tokens, attention excluded) and decode the weight bytes streamed per
second, the physical limits those phases approach, and the bare decode step as a fraction
of its roofline (every weight read once, at the measured memcpy rate). A text-only model
prefills a text prompt; ``--profile`` ends with a ``torch.profiler`` table of the bare
decode step (docs/worker.md). Run::

    python bench/worker_step.py --model small --prompt-tokens 512 --batch 8
    python bench/worker_step.py --model smollm2 --batch 16 --context 300 --levels bare,runner
"""

from __future__ import annotations

import argparse
import copy
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
from tandem.features import MultiModalKwargsItem
from tandem.shm import ShmWriter
from tandem.text.byte_tokenizer import BOS_ID
from tandem.v1 import worker_pb2_grpc
from tandem_testing.environment import memcpy_gbps
from tandem_testing.scripted import (
    ScriptedRequest,
    ScriptedScheduler,
    synthetic_image,
    synthetic_prompt,
)
from worker_svc.checkpoint import compute_dtype, load_model, resolve_device
from worker_svc.config import WorkerConfig
from worker_svc.cpu_linear import pack_linears
from worker_svc.model import ModelInputs, Transformer
from worker_svc.runner import StepRunner
from worker_svc.server import kv_cache_blocks, serve
from worker_svc.step import StepInput, StepOutput
from worker_svc.step_codec import step_output_from_proto, step_to_proto

BLOCK_SIZE = 16
IMAGE_GRID = 16  # patches per side: 64 placeholder tokens per image
SEGMENT = "features.seg"
StepFn = Callable[[StepInput], StepOutput]


class StepLevel:
    """One level driven through a step function: a prefill request, then a decode batch."""

    def __init__(self, args: argparse.Namespace, model: Transformer, tag: str, step_fn: StepFn,
                 segment: tuple[str, int] = ("", 0), writer: ShmWriter | None = None) -> None:
        self.args, self.model, self.tag, self.step_fn = args, model, tag, step_fn
        self.sched = ScriptedScheduler(BLOCK_SIZE, *segment)
        self.writer = writer
        self.times: list[float] = []

    def _timed(self, step: StepInput) -> StepOutput:
        t0 = time.perf_counter()
        out = self.step_fn(step)
        self.times.append(time.perf_counter() - t0)
        return out

    def prefill(self, rnd: int) -> float:
        """Seconds of one prefill step (encoder included)."""
        self.times.clear()
        self.sched.run(self._timed, [prefill_request(self.args, self.model, f"{self.tag}-p{rnd}",
                                                     self.writer)])
        self.step_fn(self.sched.flush())
        return self.times[0]

    def decode(self, rnd: int) -> float:
        """Median seconds of a decode step of args.batch requests."""
        self.times.clear()
        self.sched.run(self._timed, decode_requests(self.args, f"{self.tag}-d{rnd}"))
        self.step_fn(self.sched.flush())
        return statistics.median(self.times[2:])  # skip the prefill and the first decode


class BareLevel:
    """Encoder + ``model(inputs)`` alone, on inputs captured from one runner round."""

    def __init__(self, args: argparse.Namespace, model: Transformer, runner: StepRunner) -> None:
        self.args, self.model = args, model
        captured: list[ModelInputs] = []
        hook = model.register_forward_pre_hook(lambda _m, a: captured.append(a[0]))
        try:
            level = StepLevel(args, model, "capture", runner.step)
            level.prefill(0)
            level.decode(0)
        finally:
            hook.remove()
        self.prefill_inputs, self.decode_inputs = captured[0], captured[-1]
        self.pixels = [img["pixel_values"].data for _, img in images(model)]

    def on(self, model: Transformer) -> BareLevel:
        """The same captured inputs run by another copy of the model (same cache sizes)."""
        other = copy.copy(self)
        other.model = model
        return other

    @torch.inference_mode()
    def prefill(self, _rnd: int) -> float:
        t0 = time.perf_counter()
        for p in self.pixels:
            self.model.encode_image(p, IMAGE_GRID, IMAGE_GRID)
        self.model(self.prefill_inputs)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def decode(self, _rnd: int) -> float:
        times = []
        for _ in range(self.args.decode_steps):
            t0 = time.perf_counter()
            self.model(self.decode_inputs)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def images(model: Transformer) -> list[tuple[str, MultiModalKwargsItem]]:
    """Two images for a model with a vision tower, none for a text-only one."""
    if not model.config.has_vision:
        return []
    return [(f"img-{i}", synthetic_image(model.config, IMAGE_GRID, IMAGE_GRID, seed=i))
            for i in range(2)]


def prefill_request(args: argparse.Namespace, model: Transformer, rid: str,
                    writer: ShmWriter | None) -> ScriptedRequest:
    """~prompt_tokens with the model's images (``images``), one output token; address items
    when ``writer``."""
    imgs = images(model)
    if not imgs:
        return ScriptedRequest(rid, [BOS_ID] + [ord("x")] * (args.prompt_tokens - 1), [], 1)
    n_image = model.config.num_image_tokens(IMAGE_GRID, IMAGE_GRID)
    text = "x" * max(1, (args.prompt_tokens - 2 * n_image - 1) // 3)
    tokens, features = synthetic_prompt(model.config, [text, text, text], imgs)
    if writer is not None:
        features = [replace(f, data=writer.hit(k) if writer.is_cached(k)
                            else writer.put(k, item_to_parts(item)))
                    for f, (k, item) in zip(features, imgs, strict=True)]
    return ScriptedRequest(rid, tokens, features, max_new_tokens=1)


def decode_requests(args: argparse.Namespace, tag: str) -> list[ScriptedRequest]:
    """args.batch requests of args.context prompt tokens each (the decode steps' context)."""
    tokens = [BOS_ID] + [ord("a") + i % 26 for i in range(args.context - 1)]
    return [ScriptedRequest(f"{tag}-{b}", tokens, [], max_new_tokens=args.decode_steps + 1)
            for b in range(args.batch)]


def start_worker(config: WorkerConfig) -> multiprocessing.Process:
    proc = multiprocessing.get_context("spawn").Process(target=serve, args=(config,))
    proc.start()
    with grpc.insecure_channel(f"unix://{config.socket_path}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while stub.Check(health_pb2.HealthCheckRequest(), wait_for_ready=True,
                         timeout=120).status != health_pb2.HealthCheckResponse.SERVING:
            time.sleep(0.1)
    return proc


def print_environment(model: Transformer, params: int, device: torch.device) -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")} or "default"
    load = os.getloadavg()[0]
    print(f"python {platform.python_version()}  torch {torch.__version__}  grpcio "
          f"{grpc.__version__}  threads {torch.get_num_threads()}  device {device}")
    print(f"cpu {cpu}  cores {os.cpu_count()}  load {load:.1f}  malloc {malloc}")
    print(f"model {model.config.dim}d x {model.config.n_layers} layers, "
          f"{params / 1e6:.1f}M parameters\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small",
                        help="a preset, a model directory, or 'smollm2' (SmolLM2-135M-Instruct, "
                        "made once into .cache/)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64,
                        help="prompt tokens of each decode request")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--levels", default="bare,runner,grpc",
                        help="comma-separated subset of bare, runner, grpc, unpacked, "
                        "onednn, gathered (bare is always run; unpacked: the bare forward "
                        "without the CPU's prepacked linear weights; onednn: in oneDNN's "
                        "layout; gathered: without its decode attention kernel)")
    parser.add_argument("--profile", action="store_true",
                        help="print a torch.profiler table of the bare decode step")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads here and in the worker (0 = torch's default); "
                        "on a shared machine, oversubscribed OpenMP threads dominate small ops")
    args = parser.parse_args()
    if args.model == "smollm2":
        from tandem_testing.hf_models import smollm2_dir  # imports transformers the first time
        args.model = str(smollm2_dir())
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the spawned worker
        torch.set_num_threads(args.threads)

    device = resolve_device(args.device)
    model = load_model(args.model, device, compute_dtype(device))
    # Counted before packing, which turns the linear layers' weights into opaque buffers.
    params = sum(p.numel() for p in model.parameters())
    pack_linears(model)  # as the worker serves it
    shm_dir = tempfile.mkdtemp(prefix="tandem-bench-")
    # The scripted scheduler never reuses a block: room for every round of every level.
    per_round = (-(-args.prompt_tokens // BLOCK_SIZE) + 1
                 + args.batch * -(-(args.context + args.decode_steps + 1) // BLOCK_SIZE))
    kv_bytes = (args.reps + 2) * 3 * per_round * model.config.kv_bytes_per_block(
        BLOCK_SIZE, compute_dtype(device).itemsize)
    config = WorkerConfig(model=args.model, shm_dir=shm_dir, device=args.device,
                          block_size=BLOCK_SIZE, kv_cache_bytes=max(kv_bytes, 256 << 20))
    model.setup_caches(kv_cache_blocks(config, model.config, device, compute_dtype(device)),
                       BLOCK_SIZE)
    runner = StepRunner(model, receiver=None)
    print_environment(model, params, device)

    wanted = args.levels.split(",")
    bare = BareLevel(args, model, runner)
    levels: dict[str, Level] = {"bare": bare}
    if "runner" in wanted:
        levels["runner"] = StepLevel(args, model, "runner", runner.step)
    def variant(pack: Callable[[Transformer], object]) -> Transformer:
        """A second copy of the model, its linear layers laid out by ``pack``."""
        other = load_model(args.model, device, compute_dtype(device))
        pack(other)
        other.setup_caches(model.num_blocks, model.block_size)
        return other

    if "unpacked" in wanted:  # the bare forward with F.linear's weights, for the A/B
        levels["unpacked"] = bare.on(variant(lambda m: None))
    if "onednn" in wanted:  # the bare forward with oneDNN's GEMM, not the panel kernel
        levels["onednn"] = bare.on(variant(lambda m: pack_linears(m, panels=False)))
    if "gathered" in wanted:  # the bare forward with gather + SDPA decode attention
        gathering = variant(pack_linears)
        for layer in gathering.layers:
            layer.attention.kernel = None
        levels["gathered"] = bare.on(gathering)
    if "grpc" not in wanted:
        rounds = run_rounds(args, levels)
    else:
        proc = start_worker(config)
        try:
            with grpc.insecure_channel(f"unix://{config.socket_path}") as ch, ShmWriter(
                    Path(shm_dir) / SEGMENT, 64 << 20, 1, 16 << 20) as writer:
                stub = worker_pb2_grpc.WorkerStub(ch)

                def grpc_step(s: StepInput) -> StepOutput:
                    return step_output_from_proto(stub.Step(step_to_proto(s), timeout=600))

                levels["grpc"] = StepLevel(args, model, "grpc", grpc_step,
                                           (SEGMENT, writer.generation), writer)
                rounds = run_rounds(args, levels)
        finally:
            proc.terminate()
            proc.join(30)
    report(args, model, params, rounds, memcpy_gbps(256 << 20, device))
    if args.profile:
        print_profile(bare)


Level = StepLevel | BareLevel
Round = dict[str, tuple[float, float]]  # level -> (prefill s, decode step s)


def run_rounds(args: argparse.Namespace, levels: dict[str, Level]) -> list[Round]:
    """Interleaved rounds (every level once per round), so load changes hit all levels alike;
    round 0 warms up and is dropped."""
    rounds = []
    for rnd in range(args.reps + 1):
        rounds.append({name: (lv.prefill(rnd), lv.decode(rnd)) for name, lv in levels.items()})
    return rounds[1:]


def report(args: argparse.Namespace, model: Transformer, params: int, rounds: list[Round],
           copy_gbps: float) -> None:
    """Medians per level, medians of the per-round ratios to the bare level, and the bare
    decode step against its roofline (weights / memcpy rate)."""
    weight_bytes = params * model.tok_embeddings.weight.element_size()
    prompt = len(prefill_request(args, model, "n", None).token_ids)
    print(f"{'level':8}{'prefill ms':>12}{'tok/s':>10}{'GFLOP/s':>10}{'x bare':>8}"
          f"{'decode ms':>12}{'tok/s':>10}{'GB/s':>8}{'x bare':>8}")
    for name in rounds[0]:
        p = statistics.median(r[name][0] for r in rounds)
        d = statistics.median(r[name][1] for r in rounds)
        p_ratio = statistics.median(r[name][0] / r["bare"][0] for r in rounds)
        d_ratio = statistics.median(r[name][1] / r["bare"][1] for r in rounds)
        print(f"{name:8}{p * 1e3:12.1f}{prompt / p:10.0f}{2 * params * prompt / p / 1e9:10.1f}"
              f"{p_ratio:8.2f}{d * 1e3:12.2f}{args.batch / d:10.0f}"
              f"{weight_bytes / d / 1e9:8.2f}{d_ratio:8.2f}")
    print(f"\nprefill: one step of {prompt} tokens with 2 images of {IMAGE_GRID}x{IMAGE_GRID} "
          f"patches (encoder included); decode: {args.batch} requests, one token each per "
          f"step; {len(rounds)} interleaved rounds, ratios are medians of per-round ratios")
    bound = weight_bytes / copy_gbps / 1e9
    bare = statistics.median(r["bare"][1] for r in rounds)
    print(f"roofline: {weight_bytes / 1e6:.0f} MB of weights per decode step at the memcpy rate "
          f"{copy_gbps:.1f} GB/s = {bound * 1e3:.1f} ms; the bare decode step "
          f"({args.context}-token contexts) is {bound / bare:.2f} of it")


def print_profile(bare: BareLevel) -> None:
    """Where a bare decode step's time goes: ops by self CPU time over 5 steps."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU],
                                         record_shapes=True) as prof:
        for _ in range(5):
            bare.model(bare.decode_inputs)
    print(prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=40,
        max_shapes_column_width=60))


if __name__ == "__main__":
    main()
