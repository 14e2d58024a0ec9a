"""Traces and metrics of a real local cell running the seed scenario (same image and
prompt twice), exported with the real OTLP exporter to a receiver hosted here, written to
a trace file, and scraped from the scheduler's and the worker's ``/metrics``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from otlp_receiver import OtlpReceiver

from tandem.cpus import usable_cpus
from tandem.v1 import generate_pb2
from tandem_cli.cli import main
from tandem_cli.traces_view import Span, read_spans
from tandem_testing.cells import Cell, free_port_pair, png, request, running_cell
from tandem_testing.metrics import scrape

PROMPT = "Describe this picture: <image> in a few words, please, and be brief about it."
CLIENT_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
FIRST, SECOND = "obs-first", "obs-second"


@dataclass
class Scenario:
    usage: dict[str, generate_pb2.Usage]  # request id -> usage
    spans: list[Span]
    trace_file: Path
    before: dict[str, float]  # scheduler metrics before the two requests
    after: dict[str, float]
    worker: dict[str, float]  # rank 0's metrics after them


def _generate(cell: Cell, request_id: str, metadata: tuple = ()) -> generate_pb2.Usage:
    msg = request(PROMPT, [png(1)], max_tokens=12)
    msg.request_id = request_id
    *_, last = cell.stub.Generate(msg, timeout=60, metadata=metadata)
    assert last.HasField("usage")
    return last.usage


def _both_services_exported(spans: list[Span]) -> bool:
    names = {(s.service, s.name.split(" ")[0]) for s in spans}
    return {("tandem-scheduler", "generate_content"), ("tandem-worker", "tandem.worker.step"),
            ("tandem-scheduler", "tandem.mm.process")} <= names and sum(
        s.name.startswith("generate_content") for s in spans) >= 3


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    tmp = tmp_path_factory.mktemp("observability")
    trace_file = tmp / "traces.jsonl"
    port = free_port_pair()
    with OtlpReceiver() as receiver:
        flags = ("--otlp-endpoint", receiver.endpoint, "--trace-file", str(trace_file),
                 "--metrics-port", str(port))
        with running_cell(tmp, *flags) as cell:
            before = scrape(port)
            traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
            usage = {FIRST: _generate(cell, FIRST, (("traceparent", traceparent),)),
                     SECOND: _generate(cell, SECOND)}
            with pytest.raises(grpc.RpcError) as rejected:
                list(cell.stub.Generate(request("", max_tokens=4), timeout=30))
            assert rejected.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            after, worker = scrape(port), scrape(port + 1)
        # Stopping the cell flushes every process's spans.
        spans = receiver.wait_for(_both_services_exported)
    assert cell.proc.returncode == 0
    return Scenario(usage, spans, trace_file, before, after, worker)


def request_span(spans: list[Span], request_id: str) -> Span:
    [span] = [s for s in spans if s.name == "generate_content tiny"
              and s.attributes.get("gen_ai.response.id") == request_id]
    return span


def children(spans: list[Span], parent: Span, name: str) -> list[Span]:
    return [s for s in spans if s.trace_id == parent.trace_id and s.parent_id == parent.span_id
            and s.name == name]


def linked_steps(spans: list[Span], target: Span) -> list[Span]:
    return [s for s in spans if s.name == "tandem.worker.step"
            and (target.trace_id, target.span_id) in s.links]


def test_second_request_hits_every_cache(scenario: Scenario) -> None:
    span = request_span(scenario.spans, SECOND)
    a = span.attributes
    assert a["gen_ai.operation.name"] == "generate_content"
    assert a["gen_ai.usage.cache_read.input_tokens"] == scenario.usage[SECOND].cached_prompt_tokens
    assert a["gen_ai.usage.cache_read.input_tokens"] > 0
    assert a["gen_ai.usage.input_tokens"] == scenario.usage[SECOND].prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == scenario.usage[SECOND].completion_tokens
    mm = (a["tandem.mm.items"], a["tandem.mm.cache_hits"], a["tandem.mm.encoder_runs"])
    assert mm == (1, 1, 0)
    assert 0 < a["tandem.prefix_cache.hit_ratio"] <= 1
    [image] = children(scenario.spans, span, "tandem.mm.process")
    assert image.attributes["tandem.mm.cache.result"] == "hit"
    assert len(image.attributes["tandem.mm.hash"]) == 16
    assert image.attributes["tandem.shm.object_bytes"] > 0
    events = [e.name for e in span.events]
    assert events[:3] == ["queued", "prefix_cache_lookup", "scheduled"]
    assert "first_token" in events and "stripped" in events
    lookup = next(e for e in span.events if e.name == "prefix_cache_lookup")
    assert lookup.attributes["hit_blocks"] > 0
    steps = linked_steps(scenario.spans, span)
    assert steps and all(s.service == "tandem-worker" for s in steps)
    assert sum(s.attributes["tandem.encoder.runs"] for s in steps) == 0
    assert sum(s.attributes["tandem.shm.acked"] for s in steps) == 1  # its one reference


def test_first_request_misses_and_encodes(scenario: Scenario) -> None:
    span = request_span(scenario.spans, FIRST)
    a = span.attributes
    assert a["gen_ai.usage.cache_read.input_tokens"] == 0
    assert (a["tandem.mm.cache_hits"], a["tandem.mm.encoder_runs"]) == (0, 1)
    [image] = children(scenario.spans, span, "tandem.mm.process")
    assert image.attributes["tandem.mm.cache.result"] == "miss"
    second = children(scenario.spans, request_span(scenario.spans, SECOND), "tandem.mm.process")
    for key in ("tandem.mm.hash", "tandem.shm.address", "tandem.shm.monotonic_id",
                "tandem.shm.segment_generation"):
        assert image.attributes[key] == second[0].attributes[key], key  # the same object
    steps = linked_steps(scenario.spans, span)
    assert sum(s.attributes["tandem.encoder.runs"] for s in steps) == 1
    assert sum(s.attributes["tandem.shm.resolved"] for s in steps) == 1


def test_client_traceparent_becomes_the_parent(scenario: Scenario) -> None:
    first = request_span(scenario.spans, FIRST)
    [server] = [s for s in scenario.spans if s.span_id == first.parent_id]
    assert server.name == "/tandem.v1.Generation/Generate"
    assert (server.trace_id, server.parent_id) == (CLIENT_TRACE_ID, CLIENT_SPAN_ID)
    assert server.attributes["rpc.grpc.status_code"] == 0
    second = request_span(scenario.spans, SECOND)
    [server2] = [s for s in scenario.spans if s.span_id == second.parent_id]
    assert server2.parent_id == "" and server2.trace_id != CLIENT_TRACE_ID  # a new root
    assert not [s for s in scenario.spans if "Health" in s.name or "Reflection" in s.name]


def test_rejected_request_is_an_error_span(scenario: Scenario) -> None:
    [span] = [s for s in scenario.spans if s.name.startswith("generate_content")
              and s.attributes.get("error.type") == "EMPTY_PROMPT"]
    assert span.error and "gen_ai.response.id" not in span.attributes
    [server] = [s for s in scenario.spans if s.span_id == span.parent_id]
    assert server.error and server.attributes["error.type"] == "INVALID_ARGUMENT"
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_spans_never_carry_the_prompt(scenario: Scenario) -> None:
    words = {w for w in PROMPT.replace("<image>", " ").replace(",", " ").split() if len(w) > 4}
    values = []
    for s in scenario.spans:
        values += list(s.attributes.values())
        values += [v for e in s.events for v in e.attributes.values()]
    texts = [str(v) for v in values]
    assert not [t for t in texts for w in words if w in t]
    assert "picture" not in scenario.trace_file.read_text()


def test_metrics_moved_by_the_scenario(scenario: Scenario) -> None:
    delta = {k: v - scenario.before.get(k, 0.0) for k, v in scenario.after.items()}
    u1, u2 = scenario.usage[FIRST], scenario.usage[SECOND]
    assert delta["tandem_prompt_tokens_total"] == u1.prompt_tokens + u2.prompt_tokens
    assert delta["tandem_prefix_cache_hit_tokens_total"] == u2.cached_prompt_tokens > 0
    assert delta["tandem_mm_cache_hits_total"] == 1
    assert delta["tandem_mm_cache_misses_total"] == 1
    assert delta["tandem_encoder_runs_total"] == 1
    for histogram in ("time_to_first_token", "time_per_output_token", "request_duration"):
        assert delta[f"tandem_{histogram}_seconds_count"] == 2, histogram
    after = scenario.after
    assert after["tandem_shm_unacked_refs"] == 0 and after["tandem_shm_objects"] == 1
    assert 0 < after["tandem_shm_used_bytes"] <= after["tandem_shm_capacity_bytes"]
    worker = scenario.worker
    assert worker["tandem_encoder_runs_total"] == 1
    assert worker["tandem_shm_resolved_total"] == 1  # the second request's item was covered
    assert worker["tandem_shm_acked_total"] == 2
    assert worker["tandem_steps_total"] >= 2
    assert 1 <= worker["tandem_torch_threads"] <= usable_cpus()  # the team now, in its budget


def test_tandem_traces_renders_both_requests(scenario: Scenario,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    file_spans = read_spans(scenario.trace_file)
    assert {s.name for s in file_spans} == {s.name for s in scenario.spans}
    assert main(["traces", "--file", str(scenario.trace_file), "-n", "3"]) == 0
    first, second, rejected = capsys.readouterr().out.split("\n\n")
    assert first.startswith(f"request {FIRST}  trace {CLIENT_TRACE_ID}")
    assert second.startswith(f"request {SECOND}")
    assert rejected.startswith("request (rejected)") and "ERROR EMPTY_PROMPT" in rejected
    u2 = scenario.usage[SECOND]
    assert "cached 0 " in first and "encoder 1" in first and " miss " in first
    assert f"cached {u2.cached_prompt_tokens} " in second and "encoder 0" in second
    assert " hit " in second and "tandem.worker.step" in second
    assert "first_token" in second
