"""Load on an OpenAI-compatible endpoint and the serving metrics the field reports
(bench/serve.py; the names and definitions are those of ``vllm bench serve``).

A *workload* is a seeded list of chat requests, the same for every engine of a round; a
*load* is how they are sent: a fixed number of concurrent clients, or Poisson arrivals at
a request rate. Every request is streamed (server-sent events) and timed on the client:

* TTFT: from sending the request to the first chunk that carries output text;
* ITL: the gaps between consecutive chunks that carry output text;
* TPOT: ``(latency - TTFT) / (output tokens - 1)``, output tokens from the stream's usage;
* E2EL: from sending to the end of the stream;
* request throughput and output tokens/s: over the load's wall time, first send to last end;
* goodput: requests per second that met every SLO given (TTFT and/or TPOT; none given,
  no goodput).
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

from tandem_testing.cells import png

WORKLOADS = ("text", "image-repeat", "image-new-prefix", "image-unique")
# Ordinary words, about one token each in the usual BPE vocabularies: a prompt of n of them
# is about n tokens (the exact count comes back in the usage).
WORDS = ("the", "sea", "was", "calm", "and", "grey", "under", "a", "low", "sky", "while",
         "boats", "came", "home", "with", "fish", "people", "on", "shore", "waited", "for",
         "news", "from", "north", "where", "storm", "had", "been", "seen", "two", "days",
         "before", "by", "man", "who", "kept", "light")


@dataclass(frozen=True)
class Workload:
    """What is asked. ``lengths`` is ``fixed`` (every request ``input_len`` prompt words and
    ``output_len`` output tokens) or ``mixed`` (each request's two lengths drawn, seeded,
    log-uniformly between a quarter and four times those, so short and long requests share
    the batch). Image kinds put one ``image_size`` PNG in each request: ``image-repeat`` is
    one identical request (image and text) again and again; ``image-new-prefix`` the same
    image after a new text prefix each time (only a processor cache can help);
    ``image-unique`` a new image each time."""

    kind: str = "text"
    num_prompts: int = 16
    input_len: int = 128
    output_len: int = 32
    lengths: str = "fixed"
    image_size: tuple[int, int] = (112, 84)
    seed: int = 0


@dataclass(frozen=True)
class Load:
    """``concurrency`` clients each sending its next request when its last one ended, or,
    with ``rate`` (requests/s), Poisson arrivals, at most ``concurrency`` in flight (0: no
    bound)."""

    concurrency: int = 1
    rate: float | None = None
    hog: bool = False  # run beside a process spinning on CPU 0 (bench/serve.py --hog)

    @property
    def name(self) -> str:
        hog = " + CPU hog" if self.hog else ""
        if self.rate is None:
            return f"{self.concurrency} clients{hog}"
        bound = f", at most {self.concurrency}" if self.concurrency else ""
        return f"{self.rate:g} req/s{bound}{hog}"


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    max_tokens: int


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from its send."""

    ok: bool = False
    error: str = ""
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def build_requests(workload: Workload, round_no: int) -> list[ChatRequest]:
    """The workload's requests for round ``round_no`` (seeded by both: every engine gets the
    same list in a round; rounds differ, so no cache carries one round into the next)."""
    rng = random.Random(workload.seed * 1_000_003 + round_no)
    width, height = workload.image_size
    shared_image = _data_uri(png(workload.seed, width, height))
    out = []
    for i in range(workload.num_prompts):
        n_in, n_out = workload.input_len, workload.output_len
        if workload.lengths == "mixed":
            n_in, n_out = _log_uniform(rng, n_in), _log_uniform(rng, n_out)
        words = " ".join(rng.choice(WORDS) for _ in range(n_in))
        if workload.kind == "text":
            content: str | list[dict] = f"Request {round_no}.{i}: continue this story. {words}"
        elif workload.kind == "image-repeat":  # the first request's, again and again
            content = (out[0].messages[0]["content"] if out else
                       [_image(shared_image), _text(f"Describe the picture. {words}")])
        elif workload.kind == "image-new-prefix":
            content = [_text(f"Request {round_no}.{i}: {words}"), _image(shared_image),
                       _text("Describe the picture.")]
        elif workload.kind == "image-unique":
            seed = 1_000_000 * (round_no + 1) + i
            content = [_image(_data_uri(png(seed, width, height))),
                       _text(f"Request {round_no}.{i}: describe the picture. {words}")]
        else:
            raise ValueError(f"unknown workload {workload.kind!r}; one of {WORKLOADS}")
        out.append(ChatRequest([{"role": "user", "content": content}], n_out))
    return out


def _log_uniform(rng: random.Random, n: int) -> int:
    return max(1, round(math.exp(rng.uniform(math.log(n / 4), math.log(n * 4)))))


def _data_uri(png_bytes: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes).decode()


def _image(uri: str) -> dict:
    return {"type": "image_url", "image_url": {"url": uri}}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


@dataclass(frozen=True)
class Endpoint:
    """Where to send and what the engine accepts: ``min_tokens`` (vLLM's extension, which
    Tandem shares) makes every request generate exactly ``max_tokens``; engines without it
    (transformers serve refuses unknown fields) stop at EOS."""

    base_url: str  # ends with /v1
    model: str
    min_tokens: bool = True


async def run_load(endpoint: Endpoint, requests: Sequence[ChatRequest], load: Load,
                   seed: int = 0) -> tuple[list[RequestResult], float]:
    """Send ``requests`` as ``load`` says; their results (in request order) and the wall
    time from the first send to the last end."""
    results = [RequestResult() for _ in requests]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        if load.rate is None:
            queue = list(enumerate(requests))[::-1]

            async def client_loop() -> None:
                while queue:
                    i, req = queue.pop()
                    results[i] = await _one(client, endpoint, req)

            await asyncio.gather(*(client_loop() for _ in range(load.concurrency)))
        else:
            gate = asyncio.Semaphore(load.concurrency or len(requests))

            async def arrive(i: int, at: float, req: ChatRequest) -> None:
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                async with gate:
                    results[i] = await _one(client, endpoint, req)

            rng = random.Random(seed)
            at, arrivals = 0.0, []
            for i, req in enumerate(requests):
                arrivals.append(arrive(i, at, req))
                at += rng.expovariate(load.rate)
            await asyncio.gather(*arrivals)
        return results, time.perf_counter() - start


async def _one(client: httpx.AsyncClient, endpoint: Endpoint, req: ChatRequest,
               ) -> RequestResult:
    body: dict = {"model": endpoint.model, "messages": req.messages,
                  "max_tokens": req.max_tokens, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if endpoint.min_tokens:
        body["min_tokens"] = req.max_tokens
    result, chunks, last = RequestResult(), 0, 0.0
    sent = time.perf_counter()
    try:
        async with client.stream("POST", f"{endpoint.base_url}/chat/completions",
                                 json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for data in _sse_data(response):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter() - sent
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                    return result
                text = "".join((c.get("delta") or {}).get("content") or ""
                               for c in chunk.get("choices") or ())
                if text:
                    chunks += 1
                    result.text += text
                    if result.ttft is None:
                        result.ttft = now
                    else:
                        result.itl.append(now - last)
                    last = now
                if usage := chunk.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens") or 0
                    result.output_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - sent
    result.output_tokens = result.output_tokens or chunks  # no usage: a token per chunk
    result.ok = result.ttft is not None
    if not result.ok:
        result.error = "no output text"
    return result


async def _sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data:`` fields of a server-sent event stream.

    NOTE: not ``aiter_lines``, which also breaks lines at U+2028, U+0085 and the like, all
    of which JSON may carry unescaped in a token's text; the servers measured here end
    SSE lines with LF (or CRLF).
    """
    pending = b""
    async for part in response.aiter_bytes():
        *lines, pending = (pending + part).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip().decode()


@dataclass(frozen=True)
class Slo:
    """Goodput's service-level objectives, in ms; ``None`` is no objective."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and 1000 * r.ttft > self.ttft_ms:
            return False
        tpot = r.tpot
        return self.tpot_ms is None or tpot is None or 1000 * tpot <= self.tpot_ms


def summarize(results: Sequence[RequestResult], duration: float, slo: Slo) -> dict:
    """The load's metrics, as ``vllm bench serve`` names them (times in ms)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary: dict = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration,
        "request_goodput": (sum(slo.met(r) for r in ok) / duration
                            if slo.ttft_ms is not None or slo.tpot_ms is not None else None),
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [gap for r in ok for gap in r.itl], "e2el": [r.latency for r in ok]}
    for name, values in series.items():
        ms = 1000 * np.asarray(values, dtype=float)
        summary[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else None
        for p in (50, 99):
            summary[f"p{p}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else None
    return summary


def result_records(results: Sequence[RequestResult]) -> list[dict]:
    """Per-request records for the JSON output (``tpot`` included, text kept)."""
    return [dict(asdict(r), tpot=r.tpot) for r in results]
