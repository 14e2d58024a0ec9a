"""bench/serve.py end to end, shortened: it starts a real ``tandem serve`` (the built-in
``tiny`` model), sends a few streamed chat requests with images at fixed concurrency and
at a Poisson rate, each quiet and beside a CPU hog, stops it, and writes its JSON report;
the report's counts, per-request timings and the engine's startup figures are checked (no
timing thresholds: this machine's speed is not the test's subject). The ratios to a peer
are checked on a report of known figures (no peer engine is installed here)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_serve_bench_reports_every_request(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    prompts, tokens = 3, 4
    subprocess.run(
        [sys.executable, "bench/serve.py", "--engines", "tandem", "--model", "tiny",
         "--workload", "image-new-prefix", "--num-prompts", str(prompts), "--input-len", "8",
         "--output-len", str(tokens), "--concurrency", "2", "--request-rate", "50",
         "--rounds", "1", "--warmup", "1", "--slo-ttft-ms", "600000", "--hog",
         "--out", str(out)],
        cwd=ROOT, check=True, timeout=300)
    report = json.loads(out.read_text())
    loads = ["2 clients", "50 req/s", "2 clients + CPU hog", "50 req/s + CPU hog"]
    assert report["loads"] == loads
    assert [(run["engine"], run["load"]) for run in report["runs"]] == [
        ("tandem", load) for load in loads]
    for run in report["runs"]:
        s = run["summary"]
        assert (s["completed"], s["failed"]) == (prompts, 0)
        # min_tokens = max_tokens: exactly the tokens asked for, EOS or not
        assert s["total_output_tokens"] == prompts * tokens
        assert s["output_throughput"] > 0 and s["request_throughput"] > 0
        assert s["request_goodput"] == s["request_throughput"]  # a 10-minute TTFT SLO
        assert s["total_input_tokens"] > 0 and s["p50_tpot_ms"] > 0
        for r in run["requests"]:
            assert r["ok"] and r["error"] == ""
            assert 0 < r["ttft"] <= r["latency"] and r["output_tokens"] == tokens
    (startup,) = report["startups"]
    assert startup["startup_s"] > 0
    assert startup["peak_rss_bytes"] >= startup["peak_pss_bytes"] > 0
    assert set(report["summary"]["medians"]) == {f"tandem | {load}" for load in loads}
    # beside the hog, the same requests: the same greedy text
    texts = {run["load"]: [r["text"] for r in run["requests"]] for run in report["runs"]}
    assert texts["2 clients"] == texts["2 clients + CPU hog"]
    hog = report["summary"]["ratios"]["tandem hog/quiet | 2 clients"]["output_throughput"]
    assert hog > 0


def test_ratios_to_a_peer_include_latency() -> None:
    """The reference's ratios to a peer per round, their median over rounds: tokens/s, TTFT
    p50 and E2EL p50 (the repeated-image target is on warm TTFT and latency alike)."""
    spec = importlib.util.spec_from_file_location("serve_bench", ROOT / "bench" / "serve.py")
    assert spec is not None and spec.loader is not None
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)

    def run(engine: str, r: int, tps: float, ttft: float, e2el: float) -> dict:
        summary = {"output_throughput": tps, "request_throughput": tps / 8,
                   "p50_ttft_ms": ttft, "p50_e2el_ms": e2el}
        return {"engine": engine, "round": r, "load": "1 clients", "summary": summary,
                "requests": [{"text": f"{engine} {r}"}]}

    report = {"loads": ["1 clients"], "startups": [], "runs": [
        run("tandem", 0, 40.0, 30.0, 100.0), run("vllm", 0, 50.0, 40.0, 125.0),
        run("tandem", 1, 60.0, 20.0, 120.0), run("vllm", 1, 50.0, 40.0, 100.0)]}
    args = argparse.Namespace(rounds=2, reference="tandem", bound_tokens_per_s=None)
    summary = serve.summarize_report(report, ["tandem", "vllm"], args)
    ratio = summary["ratios"]["tandem/vllm | 1 clients"]
    assert ratio["output_throughput"] == (0.8 + 1.2) / 2
    assert ratio["p50_ttft_ms"] == (0.75 + 0.5) / 2
    assert ratio["p50_e2el_ms"] == (0.8 + 1.2) / 2
    assert (ratio["same_text"], ratio["requests"]) == (0, 2)
    assert summary["medians"]["tandem | 1 clients"]["p50_e2el_ms"] == 110.0
