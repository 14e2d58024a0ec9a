"""The OpenAI-compatible HTTP API next to gRPC, on one real local cell (``tandem serve``).

Prints, from one run, with rounds interleaved so machine noise hits both APIs alike: the
median time to first token and the end-to-end output tokens/s (all clients' tokens over
the wall time of the round) with 1 and 16 concurrent clients, over gRPC (``Generate``) and
over HTTP (the ``openai`` client, ``/v1/completions`` streamed), and HTTP/gRPC ratios (the
median of each pair of neighbouring rounds' ratio). Both
send the same prompt and sampling, ask for logprobs (so every token is one streamed chunk
on both, whether or not its text is complete yet) and ignore EOS, so both generate the
same number of tokens; the gap is the HTTP layer: JSON, server-sent events, uvicorn.

Usage: ``python bench/openai_http.py [--model small] [--rounds 6] [--tokens 32] [--quick]``
(not bench/http.py: run as a script, that name would shadow the standard library's http).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import fastapi
import grpc
import openai
import torch
import uvicorn

from tandem_testing.cells import Cell, free_port, request, running_cell

Run = Callable[[int, int], tuple[float, int]]  # (client, tokens) -> (TTFT s, tokens)


def prompt(client: int) -> str:
    return f"Client {client} writes a story about the sea:"


def grpc_run(cell: Cell) -> Run:
    def run(client: int, tokens: int) -> tuple[float, int]:
        msg = request(prompt(client), max_tokens=tokens, ignore_eos=True, logprobs=True)
        start, first, n = time.perf_counter(), None, 0
        for out in cell.stub.Generate(msg, timeout=600):
            if out.token_ids and first is None:
                first = time.perf_counter() - start
            n += len(out.token_ids)
        assert first is not None
        return first, n
    return run


def http_run(client_: openai.OpenAI, model: str) -> Run:
    def run(client: int, tokens: int) -> tuple[float, int]:
        start, first, n = time.perf_counter(), None, 0
        stream = client_.completions.create(
            model=model, prompt=prompt(client), max_tokens=tokens, temperature=0, logprobs=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and first is None:
                first = time.perf_counter() - start
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
        assert first is not None
        return first, n
    return run


def round_of(run: Run, clients: int, tokens: int) -> tuple[list[float], float]:
    """``clients`` concurrent requests: their TTFTs and the round's output tokens/s."""
    results: list[tuple[float, int]] = []
    threads = [threading.Thread(target=lambda i=i: results.append(run(i, tokens)))
               for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    assert len(results) == clients and all(n == tokens for _, n in results), results
    return [ttft for ttft, _ in results], clients * tokens / wall


def environment() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"python {platform.python_version()}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), grpcio {grpc.__version__}, fastapi "
            f"{fastapi.__version__}, uvicorn {uvicorn.__version__}, openai {openai.__version__}"
            f"\ncpu {cpu} x{os.cpu_count()}, load average "
            f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 round, 8 tokens")
    args = ap.parse_args()
    model, rounds, tokens = (("tiny", 1, 8) if args.quick
                             else (args.model, args.rounds, args.tokens))
    print(environment())
    print(f"model {model}, {tokens} output tokens per request, {rounds} rounds, medians\n")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, running_cell(
            Path(tmp), "--model", model, "--kv-cache-size", "256Mi", "--http-listen",
            f"127.0.0.1:{port}", debug_invariants=False) as cell:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=600)
        runs = {"grpc": grpc_run(cell), "http": http_run(client, model)}
        for run in runs.values():  # warm up both paths (connections, first-call costs)
            round_of(run, 2, 2)
        med = statistics.median
        for clients in (1, 16):
            ttfts: dict[str, list[float]] = {api: [] for api in runs}
            rates: dict[str, list[float]] = {api: [] for api in runs}
            for r in range(rounds):
                # paired rounds, the order alternating: each ratio compares neighbours in
                # time, so load from other jobs on the machine cancels out of it
                for api in (("grpc", "http") if r % 2 == 0 else ("http", "grpc")):
                    t, rate = round_of(runs[api], clients, tokens)
                    ttfts[api].append(med(t))
                    rates[api].append(rate)
            for api in runs:
                print(f"{clients:2d} clients {api:4}: TTFT {1000 * med(ttfts[api]):7.1f} ms   "
                      f"{med(rates[api]):7.1f} output tok/s")
            ttft_ratio = med(h / g for h, g in zip(ttfts["http"], ttfts["grpc"], strict=True))
            rate_ratio = med(h / g for h, g in zip(rates["http"], rates["grpc"], strict=True))
            print(f"{clients:2d} clients http/grpc (median of paired rounds): TTFT "
                  f"{ttft_ratio:.2f}x   tok/s {rate_ratio:.2f}x\n")


if __name__ == "__main__":
    main()
