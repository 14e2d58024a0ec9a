"""Structured output (issue 25): what a constrained request yields, from outside.

The real engine (in this process, ``TANDEM_DEBUG_INVARIANTS=1``) drives a real worker process
running the random ``tiny`` model, whose logits favour no structure at all, with a KV pool
small enough to preempt: whatever it samples under a constraint must be valid (JSON schemas
checked with ``jsonschema``, regexes with ``re.fullmatch``, choices and a Lark grammar by
their equivalent regex); greedy outputs are the same with asynchronous scheduling on and off
(on: a step's masks follow it, once the step before is applied);
a request cut by ``max_tokens`` says LENGTH. Over a ``tandem serve`` cell: a bad schema is
INVALID_ARGUMENT (reason BAD_CONSTRAINT) over gRPC and 400 ``param: response_format`` over
HTTP, the ``openai`` SDK's ``chat.completions.parse`` with a pydantic model works, and the
usage and the request's span say which constraint it had, its compile time and whether the
compile cache served it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import grpc
import httpx
import jsonschema
import openai
import pydantic
import pytest
from engines import idle, running_engine
from workers import running_worker

from scheduler_svc.engine import Engine
from tandem.errors import error_info
from tandem.v1 import generate_pb2, generate_pb2_grpc
from tandem_cli.traces_view import read_spans
from tandem_testing.cells import Cell, free_port, free_port_pair, request, running_cell
from tandem_testing.metrics import scrape
from worker_svc.config import WorkerConfig
from worker_svc.model_config import PRESETS

BLOCK = 4
NUM_BLOCKS = 40  # less than the concurrent requests need at their longest: preemptions
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"}},
     "required": ["name", "age", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {
        "point": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9},
                  "minItems": 2, "maxItems": 2},
        "label": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
     "required": ["point"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
               {"type": "string", "maxLength": 3}, {"const": [1, "x"]}]},
    {"type": "object", "properties": {
        "inner": {"type": "object", "properties": {"k": {"const": "v"}}, "required": ["k"],
                  "additionalProperties": False},
        "opt": {"type": "boolean"}, "e": {"enum": [1, "two", False]}},
     "required": ["inner"], "additionalProperties": False},
]
REGEX = r"[0-9]{3}-[a-z]{1,4}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'start: greeting " " name\ngreeting: "hi" | "hello"\nname: /[a-z]{1,5}/\n'
GRAMMAR_AS_REGEX = r"(hi|hello) [a-z]{1,5}"
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    shm = tmp_path_factory.mktemp("shm")
    config = WorkerConfig(shm_dir=str(shm), block_size=BLOCK, kv_cache_bytes=NUM_BLOCKS
                          * PRESETS["tiny"].kv_bytes_per_block(BLOCK, 4))
    with running_worker(config):
        yield shm


def _engine(shm: Path, on: bool):
    return running_engine(shm, block_size=BLOCK, async_scheduling=on)


def _constrained(kind: str, value: object, seed: int, temperature: float = 1.0,
                 max_tokens: int = MAX_TOKENS) -> generate_pb2.GenerateRequest:
    msg = request(f"Answer {seed}: ", max_tokens=max_tokens, temperature=temperature,
                  seed=seed)
    if kind == "choice":
        msg.sampling.choice.choices.extend(value)  # type: ignore[arg-type]
    else:
        setattr(msg.sampling, kind, value)
    return msg


async def _run(e: Engine, msg: generate_pb2.GenerateRequest) -> tuple[str, list[int], int]:
    text, tokens, reason = "", [], 0
    async for _, out in e.generate(msg):
        text, tokens, reason = text + out.text, tokens + out.token_ids, out.finish_reason
    return text, tokens, reason


def _cases() -> list[tuple[str, object]]:
    return ([("json_schema", json.dumps(s)) for s in SCHEMAS]
            + [("json_object", True), ("regex", REGEX), ("choice", CHOICES),
               ("grammar", GRAMMAR)])


def _check(kind: str, value: object, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(str(value)))
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(GRAMMAR_AS_REGEX, text), text


def test_sampled_outputs_satisfy_their_constraint(worker: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kind under several seeds, all at once (batched, some preempted): each ends
    with STOP, valid; ``json_object`` may run out of tokens first (LENGTH, a prefix)."""
    monkeypatch.setenv("TANDEM_DEBUG_INVARIANTS", "1")
    cases = [(kind, value, seed) for kind, value in _cases() for seed in range(4)]

    async def main() -> list[tuple[str, list[int], int]]:
        async with _engine(worker, True) as e:
            outs = await asyncio.gather(*(_run(e, _constrained(k, v, s)) for k, v, s in cases))
            await idle(e)
            assert e.errors == 0 and e.invariant_checks > 0
            assert e.counters.preemptions > 0, "the pool is too large to preempt"
            return outs

    outs = asyncio.run(main())
    for (kind, value, _), (text, _, reason) in zip(cases, outs, strict=True):
        if kind == "json_object" and reason == generate_pb2.FINISH_REASON_LENGTH:
            continue  # an unbounded object cut by max_tokens
        assert reason == generate_pb2.FINISH_REASON_STOP, (kind, text, reason)
        _check(kind, value, text)
    finished = sum(r == generate_pb2.FINISH_REASON_STOP for _, _, r in outs)
    assert finished >= len(cases) - 4, "most json_object outputs should complete too"


def test_greedy_constrained_outputs_are_the_same_with_async_scheduling_on_and_off(
        worker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy, concurrently (so the pool preempts mid-JSON), with two steps out or one; a
    request cut by max_tokens says LENGTH and holds a prefix of a valid output."""
    monkeypatch.setenv("TANDEM_DEBUG_INVARIANTS", "1")
    cases = [*_cases() * 3, ("json_schema", json.dumps(SCHEMAS[0]))]  # 3: enough to preempt

    async def workload(on: bool) -> tuple[list[tuple[str, list[int], int]], int, int]:
        async with _engine(worker, on) as e:
            deferred = 0
            send = e.workers.send

            async def counting_send(msg):  # delegates: counts masks sent after their step
                nonlocal deferred
                deferred += len(msg.deferred_mask_ids)
                return await send(msg)

            e.workers.send = counting_send  # type: ignore[method-assign]
            outs = await asyncio.gather(*(
                _run(e, _constrained(k, v, i, temperature=0.0,
                                     max_tokens=5 if i == len(cases) - 1 else MAX_TOKENS))
                for i, (k, v) in enumerate(cases)))
            await idle(e)
            assert e.errors == 0 and e.worker_losses == 0
            return outs, e.counters.preemptions, deferred

    (off, off_preempted, off_deferred), (on, on_preempted, on_deferred) = (
        asyncio.run(workload(False)), asyncio.run(workload(True)))
    assert on == off
    assert off_preempted > 0 and on_preempted > 0, "the pool is too large to preempt"
    assert off_deferred == 0 and on_deferred > 100, "two steps out: masks follow their step"
    text, tokens, reason = off[-1]
    assert reason == generate_pb2.FINISH_REASON_LENGTH and len(tokens) == 5
    assert text[0] == "{" and '"name"'.startswith(text[1:].lstrip()), text  # a prefix


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port_pair()


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory,
         metrics_port: int) -> Iterator[tuple[Cell, str]]:
    """A cell with its HTTP port, writing its spans to ``trace.jsonl`` every 0.1 s,
    serving metrics on ``metrics_port`` (worker 0: the port after it)."""
    port = free_port()
    tmp = tmp_path_factory.mktemp("structured")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # read when the cell starts
        running = running_cell(tmp, "--http-listen", f"127.0.0.1:{port}",
                               "--trace-file", str(tmp / "trace.jsonl"),
                               "--metrics-port", str(metrics_port))
        cell = running.__enter__()
    try:
        yield cell, f"http://127.0.0.1:{port}"
    finally:
        running.__exit__(None, None, None)


@pytest.mark.parametrize("kind, spec", [
    ("json_schema", '{"type": "nonsense"}'), ("json_schema", "{not json"),
    ("regex", "[a-"), ("grammar", "start: undefined_rule"), ("choice", [""])])
def test_a_bad_constraint_is_invalid_argument_over_grpc(cell: tuple[Cell, str], kind: str,
                                                       spec: object) -> None:
    msg = _constrained(kind, spec, 0)
    stub = generate_pb2_grpc.GenerationStub(cell[0].channel)
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(msg, timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(refused.value)
    assert info is not None and info.reason == "BAD_CONSTRAINT", refused.value.details()
    assert "Traceback" not in (refused.value.details() or "")


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema",
                         "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
    {"structured_outputs": {"regex": "(unclosed"}},
])
@pytest.mark.parametrize("path", ["chat/completions", "completions"])
def test_a_bad_schema_is_a_400_naming_response_format(cell: tuple[Cell, str], path: str,
                                                       body: dict) -> None:
    prompt = ({"messages": [{"role": "user", "content": "Hi"}]} if path.startswith("chat")
              else {"prompt": "Hi"})
    answer = httpx.post(f"{cell[1]}/v1/{path}", timeout=30,
                        json={"model": "tiny", "max_tokens": 8, **prompt, **body})
    _assert_bad_constraint(answer)


def _assert_bad_constraint(answer: httpx.Response) -> None:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == ("response_format", "bad_constraint"), error


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(min_length=1, max_length=5)
    kind: Literal["cat", "dog"]
    age: int = pydantic.Field(ge=0, le=30)
    vaccinated: bool


def test_openai_sdk_parse_with_a_pydantic_model(cell: tuple[Cell, str]) -> None:
    client = openai.OpenAI(base_url=f"{cell[1]}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    for seed in range(2):
        completion = client.chat.completions.parse(
            model="tiny", response_format=Pet, max_tokens=200, seed=seed,
            messages=[{"role": "user", "content": "Describe a pet as JSON."}])
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Pet), choice.message.content
    # vLLM's extension on the legacy endpoint
    answer = httpx.post(f"{cell[1]}/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": "Colour: ", "max_tokens": 8,
        "structured_outputs": {"choice": CHOICES}})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] in CHOICES


def test_usage_and_span_say_the_constraint_and_its_compile(cell: tuple[Cell, str],
                                                           metrics_port: int) -> None:
    """The same schema twice over HTTP (the first compiles it, the second finds it
    cached), a regex over gRPC and free text: each one's usage and ``generate_content``
    span name the constraint, its compile time and whether the cache served it; the
    scheduler's mask time and the worker's wait for deferred masks are histograms."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
              "required": ["n"], "additionalProperties": False}  # no other test sends it
    ids, usages = [], []  # usages: (kind, compile_ms, cache_hit) or None
    for _ in range(2):
        answer = httpx.post(f"{cell[1]}/v1/chat/completions", timeout=30, json={
            "model": "tiny", "max_tokens": 20, "messages": [{"role": "user", "content": "N?"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "n", "schema": schema}}})
        assert answer.status_code == 200, answer.text
        ids.append(answer.headers["x-request-id"])
        usages.append(tuple(answer.json()["usage"]["tandem"]["constraint"].values()))
    assert [(kind, hit) for kind, _, hit in usages] == [("json_schema", False),
                                                         ("json_schema", True)]
    assert usages[0][1] > 0 and usages[1][1] >= 0
    stub = generate_pb2_grpc.GenerationStub(cell[0].channel)
    for msg in (_constrained("regex", REGEX, 0, max_tokens=12), request("Hi", max_tokens=2)):
        *_, last = stub.Generate(msg, timeout=30)
        ids.append(last.request_id)
        c = last.usage.constraint
        usages.append((c.kind, c.compile_ms, c.cache_hit) if last.usage.HasField("constraint")
                      else None)
    assert usages[2][0] == "regex" and usages[3] is None

    trace_file = cell[0].shm_dir.parent / "trace.jsonl"
    deadline = time.monotonic() + 20
    while True:  # spans are written in batches, every 0.1 s here
        spans = {s.attributes.get("gen_ai.response.id"): s.attributes
                 for s in read_spans(trace_file) if s.name.startswith("generate_content")}
        if set(ids) <= spans.keys() or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for rid, (kind, ms, hit) in zip(ids[:3], usages[:3], strict=True):
        attributes = spans[rid]
        assert (attributes["tandem.constraint.kind"], attributes["tandem.constraint.cache_hit"],
                attributes["tandem.constraint.compile_ms"]) == (kind, hit, pytest.approx(ms))
    assert "tandem.constraint.kind" not in spans[ids[3]]
    # the mask histograms: the scheduler computed masks, the worker waited for deferred ones
    scheduler, worker = scrape(metrics_port), scrape(metrics_port + 1)
    assert scheduler["tandem_scheduler_mask_seconds_count"] > 0
    assert worker["tandem_worker_mask_wait_seconds_count"] > 0
