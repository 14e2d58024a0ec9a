"""A shortened soak (bench/soak.py): 400 requests, 16 concurrent, Zipf image reuse, shared
prefixes, client cancellations (half of them retried at once with the same request id), a
worker stopped (SIGSTOP) past the step timeout at a quarter and killed halfway; at the end
nothing is pinned or allocated, the ledger agrees with the segment, RSS is flat after
warm-up and no status was unexpected."""

from __future__ import annotations

from pathlib import Path

from tandem_testing.cells import free_port, running_cell
from tandem_testing.soak import Soak, SoakConfig, cell_flags, print_report


def test_soak_with_a_worker_restart(tmp_path: Path) -> None:
    config = SoakConfig(requests=400, concurrency=16, images=24, cancel=0.08, restart_at=0.5,
                        stop_at=0.25, seed=7)
    metrics = free_port()
    with running_cell(tmp_path, *cell_flags(metrics, config)) as cell:
        report = Soak(cell, config, metrics).run()
    assert print_report(report, config) == []
    assert report.statuses["OK"] > 300 and report.statuses["CANCELLED"] > 0
    assert report.same_id_retries > 0
    assert report.restart_window is not None and report.stop_window is not None
    assert report.end["worker_losses_total"] == 2  # the stop (a timed-out step), the kill
    assert report.end["invariant_checks_total"] > 0 and report.end["engine_errors_total"] == 0
    assert report.end["mm_cache_hits_total"] > report.end["mm_cache_misses_total"] / 2
    assert report.end["prefix_cache_hit_tokens_total"] > 0
