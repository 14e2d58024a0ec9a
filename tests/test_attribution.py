"""Per-image attribution and the reuse curve in a real local cell, over gRPC, in the
exported spans (a real OTLP receiver), in ``tandem generate``, ``tandem traces``,
CacheStats and ``/metrics``.

The request under test carries three images: C, covered by the prefix a warm-up request
cached (a processor-cache hit the encoder skips), A, sent by the warm-up too but behind
the point where the prompts diverge (a hit the workers' encoder cache still holds), and B,
new (a miss the encoder runs). A fourth request's image is too large for the segment's
per-object cap and travels inline.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from otlp_receiver import OtlpReceiver

from tandem.v1 import generate_pb2 as pb
from tandem_cli.cli import main
from tandem_cli.traces_view import Span
from tandem_testing.cells import free_port, png, request, running_cell
from tandem_testing.metrics import scrape

# 52 characters before the divergence: C's placeholders end inside the first two blocks.
SHARED = "Look at <image> and then, please, at the one after it: "
WARM = SHARED + "the first is <image>."
THREE = SHARED + "a different tail so the prefix stops <image> here, then <image>."
C, A, B = png(11), png(12), png(13)
BIG = png(14, 224, 224)  # ~602 KB processed, over the 200 KiB cap


@dataclass
class Run:
    usage: pb.Usage
    big: pb.Usage
    stats: pb.CacheStatsResponse
    metrics: dict[str, float]
    spans: list[Span]
    trace_file: Path
    cli: str  # what `tandem generate` printed to stderr


def _usage(cell, request_id: str, prompt: str, images: list[bytes]) -> pb.Usage:
    msg = request(prompt, images, max_tokens=4)
    msg.request_id = request_id
    *_, last = cell.stub.Generate(msg, timeout=60)
    assert last.HasField("usage")
    return last.usage


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("attribution")
    trace_file, metrics = tmp / "traces.jsonl", free_port()
    for name, data in (("c.png", C), ("a.png", A), ("b.png", B)):
        (tmp / name).write_bytes(data)
    with OtlpReceiver() as receiver:
        with running_cell(tmp, "--otlp-endpoint", receiver.endpoint, "--trace-file",
                          str(trace_file), "--mm-cache-max-object-size", "200Ki",
                          "--metrics-port", str(metrics)) as cell:
            _usage(cell, "warm", WARM, [C, A])
            usage = _usage(cell, "three", THREE, [C, A, B])
            big = _usage(cell, "big", "Big <image> here.", [BIG])
            stats, scraped = cell.stats(), scrape(metrics)
            cli = _cli_generate(cell.target, tmp)
        spans = receiver.wait_for(lambda s: sum(x.name == "tandem.mm.process" for x in s) >= 6)
    return Run(usage, big, stats, scraped, spans, trace_file, cli)


def _cli_generate(target: str, tmp: Path) -> str:
    """``tandem generate`` with the three images again, its stderr."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["generate", THREE, "--target", target, "--max-tokens", "2",
                     *(f"--image={tmp / n}" for n in ("c.png", "a.png", "b.png"))]) == 0
    return err.getvalue()


def test_each_image_says_where_its_work_came_from(run: Run) -> None:
    c, a, b = run.usage.images
    assert len({c.key, a.key, b.key}) == 3 and all(len(i.key) == 64 for i in (c, a, b))
    assert (c.processor_cache, c.transport, c.encoder) == (
        pb.PROCESSOR_CACHE_RESULT_HIT, pb.IMAGE_TRANSPORT_SHM, pb.ENCODER_RESULT_SKIPPED)
    assert c.cached_tokens == c.tokens > 0  # the whole span inside the prefix hit
    assert (a.processor_cache, a.transport, a.encoder, a.cached_tokens) == (
        pb.PROCESSOR_CACHE_RESULT_HIT, pb.IMAGE_TRANSPORT_SHM, pb.ENCODER_RESULT_CACHED, 0)
    assert (b.processor_cache, b.transport, b.encoder, b.cached_tokens) == (
        pb.PROCESSOR_CACHE_RESULT_MISS, pb.IMAGE_TRANSPORT_SHM, pb.ENCODER_RESULT_RAN, 0)
    assert not (c.refused_reason or a.refused_reason or b.refused_reason)
    u = run.usage
    assert sum(i.cached_tokens for i in u.images) <= u.cached_prompt_tokens
    assert (u.mm_items, u.mm_cache_hits, u.encoder_runs) == (3, 2, 1)


def test_an_image_over_the_object_cap_travels_inline_and_says_why(run: Run) -> None:
    [big] = run.big.images
    assert (big.processor_cache, big.refused_reason, big.transport, big.encoder) == (
        pb.PROCESSOR_CACHE_RESULT_REFUSED, "oversize", pb.IMAGE_TRANSPORT_INLINE,
        pb.ENCODER_RESULT_RAN)


def _image_spans(run: Run, request_id: str) -> list[Span]:
    [parent] = [s for s in run.spans if s.name.startswith("generate_content")
                and s.attributes.get("gen_ai.response.id") == request_id]
    return sorted((s for s in run.spans if s.name == "tandem.mm.process"
                   and (s.trace_id, s.parent_id) == (parent.trace_id, parent.span_id)),
                  key=lambda s: s.start_ns)


def test_the_image_spans_carry_the_same_facts(run: Run) -> None:
    spans = _image_spans(run, "three")
    facts = [(s.attributes["tandem.mm.cache.result"], s.attributes["tandem.mm.transport"],
              s.attributes["tandem.mm.encoder.result"], s.attributes["tandem.mm.cached_tokens"])
             for s in spans]
    c, a, b = run.usage.images
    assert facts == [("hit", "shm", "skipped", c.cached_tokens), ("hit", "shm", "cached", 0),
                     ("miss", "shm", "ran", 0)]
    assert [s.attributes["tandem.mm.hash"] for s in spans] == [i.key[:16] for i in (c, a, b)]
    # ended when their delivery was, not with the request
    request_end = max(s.end_ns for s in run.spans
                      if s.attributes.get("gen_ai.response.id") == "three")
    assert all(s.end_ns < request_end for s in spans)
    [big] = _image_spans(run, "big")
    assert (big.attributes["tandem.mm.cache.result"], big.attributes["tandem.mm.transport"],
            big.attributes["tandem.mm.cache.refused_reason"]) == ("refused", "inline", "oversize")


def test_tandem_generate_and_traces_print_one_line_per_image(
        run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [line.split() for line in run.cli.splitlines() if line.startswith("  image ")]
    assert [line[:2] for line in lines] == [["image", "1"], ["image", "2"], ["image", "3"]]
    # the CLI's own request: all three cached now, and its prefix covers C again
    assert lines[0][3:] == ["cache", "hit", "shm", "encoder", "skipped", "prefix",
                            f"{run.usage.images[0].tokens}/{run.usage.images[0].tokens}",
                            "tokens"]
    assert main(["traces", "--file", str(run.trace_file), "-n", "4"]) == 0
    block = next(b for b in capsys.readouterr().out.split("\n\n") if "request three" in b)
    rows = [r.split("ms  ")[1].split()[:9] for r in block.splitlines() if "tandem.mm.process" in r]
    c, a, b = run.usage.images
    assert rows == [
        [c.key[:16], "cache", "hit", "shm", "encoder", "skipped", "prefix",
         f"{c.tokens}/{c.tokens}", "tokens"],
        [a.key[:16], "cache", "hit", "shm", "encoder", "cached", "prefix", f"0/{a.tokens}",
         "tokens"],
        [b.key[:16], "cache", "miss", "shm", "encoder", "ran", "prefix", f"0/{b.tokens}",
         "tokens"]]


def test_cache_stats_and_metrics_report_the_reuse_curve(run: Run) -> None:
    s = run.stats
    assert s.mm_cache_curve_references == 6  # 2 + 3 + 1 deliveries, before the CLI's
    assert s.mm_cache_capacity_bytes == 256 << 20
    assert [p.capacity_bytes for p in s.mm_cache_curve] == [
        int(s.mm_cache_capacity_bytes * f) for f in (0.25, 0.5, 1, 2, 4)]
    # 4 distinct images in 6 references; each hit's distance is a few objects, far below
    # a quarter of the capacity, so every point gets both hits
    assert s.mm_cache_achievable_hit_ratio == pytest.approx(2 / 6)
    assert all(p.hit_ratio == pytest.approx(2 / 6) for p in s.mm_cache_curve)
    assert 0 < s.mm_cache_recommended_bytes < s.mm_cache_capacity_bytes // 100
    assert s.requests_in_flight == 0 and s.shm_unacked_refs == 0
    m = run.metrics
    assert m["tandem_mm_cache_capacity_bytes"] == s.mm_cache_capacity_bytes
    assert m["tandem_mm_cache_recommended_bytes"] == s.mm_cache_recommended_bytes
    assert m["tandem_mm_cache_achievable_hit_ratio"] == pytest.approx(2 / 6)
    assert m["tandem_mm_cache_curve_references_total"] == 6
    for p in s.mm_cache_curve:
        assert m[f"tandem_mm_cache_estimated_hit_ratio{{capacity_bytes={p.capacity_bytes}}}"] \
            == pytest.approx(p.hit_ratio)
