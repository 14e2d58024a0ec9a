"""``tandem traces``: the last requests of a trace file, as span trees with cache columns.

Reads the OTLP JSON lines that ``tandem serve --trace-file`` writes (one ``TracesData``
per line, from the scheduler and the workers alike), so a user with no tracing backend
still sees, per request: the server and ``generate_content`` spans with their durations,
each image's processor-cache result and segment address, the scheduling events, and the
worker steps that link to the request.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem_cli import attribution

REQUEST_SPAN_PREFIX = "generate_content "
IMAGE_SPAN = "tandem.mm.process"
STEP_SPAN = "tandem.worker.step"
_NAME_WIDTH = 40
_STATUS_ERROR = 2  # OTLP Status.code


@dataclass(frozen=True)
class Event:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass
class Span:
    """One span of the file, with its attributes decoded from OTLP ``AnyValue``s."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    error: bool = False

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def read_spans(path: Path) -> list[Span]:
    """Every span in the file; a line cut short by a crash is skipped."""
    spans: list[Span] = []
    with path.open() as f:
        for line in f:
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue
            spans.extend(spans_from_otlp_json(data))
    return spans


def spans_from_otlp_json(data: dict[str, Any]) -> Iterator[Span]:
    """The spans of one OTLP/JSON ``TracesData`` (or ``ExportTraceServiceRequest``)."""
    for resource_spans in data.get("resourceSpans", ()):
        resource = _attributes(resource_spans.get("resource", {}).get("attributes", ()))
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for s in scope_spans.get("spans", ()):
                yield Span(
                    trace_id=s["traceId"], span_id=s["spanId"], parent_id=s.get("parentSpanId", ""),
                    name=s["name"], service=service, start_ns=int(s["startTimeUnixNano"]),
                    end_ns=int(s["endTimeUnixNano"]),
                    attributes=_attributes(s.get("attributes", ())),
                    events=[Event(e["name"], int(e["timeUnixNano"]),
                                  _attributes(e.get("attributes", ())))
                            for e in s.get("events", ())],
                    links=[(link["traceId"], link["spanId"]) for link in s.get("links", ())],
                    error=s.get("status", {}).get("code", 0) == _STATUS_ERROR)


def _attributes(items: Iterable[dict[str, Any]]) -> dict[str, Any]:
    return {kv["key"]: _value(kv.get("value", {})) for kv in items}


def _value(v: dict[str, Any]) -> Any:
    if "intValue" in v:
        return int(v["intValue"])  # int64 travels as a string in OTLP/JSON
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", ())]
    for key in ("stringValue", "doubleValue", "boolValue"):
        if key in v:
            return v[key]
    return None


def render_file(path: Path, n: int) -> str:
    return render(read_spans(path), n)


def render(spans: list[Span], n: int) -> str:
    """The last ``n`` requests (by start), oldest first, each as a tree."""
    requests = sorted((s for s in spans if s.name.startswith(REQUEST_SPAN_PREFIX)),
                      key=lambda s: s.start_ns)[-n:] if n > 0 else []
    if not requests:
        return "no requests in the trace file yet"
    by_id = {(s.trace_id, s.span_id): s for s in spans}
    children: dict[tuple[str, str], list[Span]] = defaultdict(list)
    linked: dict[tuple[str, str], list[Span]] = defaultdict(list)
    for s in spans:
        children[(s.trace_id, s.parent_id)].append(s)
        for link in s.links:
            linked[link].append(s)
    blocks = []
    for request in requests:
        server = by_id.get((request.trace_id, request.parent_id))
        images = sorted(children[(request.trace_id, request.span_id)], key=lambda s: s.start_ns)
        steps = linked[(request.trace_id, request.span_id)]
        blocks.append("\n".join(_request_block(request, server, images, steps)))
    return "\n\n".join(blocks)


def _request_block(request: Span, server: Span | None, images: list[Span],
                   steps: list[Span]) -> Iterator[str]:
    a = request.attributes
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(request.start_ns / 1e9))
    yield (f"request {a.get('gen_ai.response.id', '(rejected)')}  trace {request.trace_id}  {when}"
           + ("  ERROR " + str(a.get("error.type", "")) if request.error else ""))
    indent = ""
    if server is not None:
        code = server.attributes.get("rpc.grpc.status_code", "?")
        yield _row(server.name, server.duration_ms, f"grpc status {code}")
        indent = "  "
    yield _row(indent + "└─ " + request.name, request.duration_ms, _request_columns(a))
    inner = indent + "   "
    rows = [(s.name, s.duration_ms, _image_columns(s.attributes)) for s in images]
    rows += _step_rows(steps)
    for i, (name, ms, columns) in enumerate(rows):
        yield _row(f"{inner}{'├─' if i < len(rows) - 1 else '└─'} {name}", ms, columns)
    if request.events:
        yield f"{inner}   events: " + _events(request)


def _row(name: str, ms: float, columns: str) -> str:
    return f"{name:<{_NAME_WIDTH}} {ms:9.1f} ms  {columns}".rstrip()


def _request_columns(a: dict[str, Any]) -> str:
    if "gen_ai.usage.input_tokens" not in a:
        return "rejected before scheduling"
    prompt = a["gen_ai.usage.input_tokens"]
    cached = a.get("gen_ai.usage.cache_read.input_tokens", "?")
    ratio = a.get("tandem.prefix_cache.hit_ratio")
    hit = f" ({ratio:.0%})" if isinstance(ratio, float) else ""
    reasons = ",".join(a.get("gen_ai.response.finish_reasons") or ["?"])
    mm_hits, encoder = a.get("tandem.mm.cache_hits", "?"), a.get("tandem.mm.encoder_runs", "?")
    return (f"prompt {prompt} cached {cached}{hit} | images {a.get('tandem.mm.items', 0)} "
            f"mm hits {mm_hits} encoder {encoder} | out "
            f"{a.get('gen_ai.usage.output_tokens', '?')} {reasons}")


def _image_columns(a: dict[str, Any]) -> str:
    """The columns of ``tandem generate``'s image lines, then where the data went."""
    line = attribution.columns(str(a.get("tandem.mm.hash", "?")),
                               str(a.get("tandem.mm.cache.result", "?")),
                               str(a.get("tandem.mm.cache.refused_reason", "")),
                               str(a.get("tandem.mm.transport", "?")),
                               str(a.get("tandem.mm.encoder.result", "?")),
                               a.get("tandem.mm.cached_tokens", "?"),
                               a.get("tandem.mm.num_tokens", "?"))
    if "tandem.shm.address" in a:
        line += (f"  @{a['tandem.shm.address']} id {a.get('tandem.shm.monotonic_id')} "
                 f"{_size(a.get('tandem.shm.object_bytes', 0))}")
    elif "tandem.mm.processed_bytes" in a:
        line += f"  {_size(a['tandem.mm.processed_bytes'])}"
    return line


def _step_rows(steps: list[Span]) -> list[tuple[str, float, str]]:
    """One row per worker rank: how many steps served the request and what they did.

    The counts are the steps' own totals (a step may serve other requests too).
    """
    by_rank: dict[Any, list[Span]] = defaultdict(list)
    for s in steps:
        by_rank[s.attributes.get("tandem.worker.rank", "?")].append(s)
    rows: list[tuple[str, float, str]] = []
    for rank, group in sorted(by_rank.items(), key=lambda kv: str(kv[0])):
        total_ms = sum(s.duration_ms for s in group)
        sums = {key: sum(int(s.attributes.get(f"tandem.{key}", 0)) for s in group)
                for key in ("shm.resolved", "shm.acked", "encoder.runs")}
        rows.append((f"{STEP_SPAN} x{len(group)} (linked)", total_ms,
                     f"rank {rank} resolved {sums['shm.resolved']} acked {sums['shm.acked']} "
                     f"encoder {sums['encoder.runs']}"))
    return rows


def _events(span: Span) -> str:
    parts = []
    for e in span.events:
        offset = (e.time_ns - span.start_ns) / 1e6
        detail = ""
        if e.name == "prefix_cache_lookup":
            detail = f" {e.attributes.get('hit_blocks')}/{e.attributes.get('total_blocks')} blocks"
        elif e.name == "stripped":
            detail = (f" {e.attributes.get('items')} dropped, "
                      f"{e.attributes.get('by_reference')} by reference")
        parts.append(f"{e.name} +{offset:.1f}ms{detail}")
    return ", ".join(parts)


def _size(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"
