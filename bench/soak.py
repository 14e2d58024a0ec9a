"""Soak a local cell: thousands of requests, a worker stopped then killed, and a leak check.

Load: ``--concurrency`` client threads; each request takes one of a few shared prompt
prefixes, 0-2 images drawn from a pool with Zipf-like reuse (image k has weight 1/(k+1)^s),
and a few output tokens; ``--cancel`` of the streams are cancelled by the client after a
random number of messages, and ``--retry-same-id`` of those are sent again at once with the
same ``request_id`` (a proxy retrying with its ``x-request-id``). When ``--stop-at`` of the
requests are done, the worker is stopped (SIGSTOP) for ``--stop-for`` seconds, past the
``--step-timeout``, then continued; when ``--restart-at`` are done, it is killed with
SIGKILL and ``tandem serve`` restarts it. Clients retry UNAVAILABLE with backoff, as a real
client would. The cell checks its delivery ledger against the segment after every step
(``TANDEM_DEBUG_INVARIANTS=1``).

Pass criteria (exit status 1 otherwise), printed with every count:

* zero unexpected statuses: OK, client CANCELLED, and UNAVAILABLE between a fault and the
  cell being ready again (plus a second) are the only ones allowed (a retry refused as a
  duplicate id, or failed as internal, is unexpected);
* at the end, idle: ``shm_unacked_refs`` 0 and equal to the ledger's references, every KV
  block free, and no error caught by the engine loop (a failed ledger check is one);
* RSS flat after warm-up: the scheduler's RSS at the end is within ``--rss-slack`` of its
  RSS after the warm-up (the first ``--warmup`` of the requests), and the restarted
  worker's likewise from its own warm-up.

Usage: ``python bench/soak.py [--requests 3000] [--concurrency 16] [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tandem_testing.cells import free_port, running_cell
from tandem_testing.soak import Soak, SoakConfig, cell_flags, print_report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--images", type=int, default=48)
    ap.add_argument("--cancel", type=float, default=0.05)
    ap.add_argument("--retry-same-id", type=float, default=0.5,
                    help="fraction of cancelled streams retried at once with the same id")
    ap.add_argument("--restart-at", type=float, default=0.5)
    ap.add_argument("--stop-at", type=float, default=0.25)
    ap.add_argument("--stop-for", type=float, default=6.0, help="seconds (> --step-timeout)")
    ap.add_argument("--step-timeout", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="300 requests")
    args = ap.parse_args()
    config = SoakConfig(requests=300 if args.quick else args.requests,
                        concurrency=args.concurrency, images=args.images, cancel=args.cancel,
                        retry_same_id=args.retry_same_id,
                        restart_at=args.restart_at, stop_at=args.stop_at,
                        stop_for=args.stop_for, step_timeout=args.step_timeout, seed=args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        metrics = free_port()
        with running_cell(Path(tmp), *cell_flags(metrics, config)) as cell:
            report = Soak(cell, config, metrics).run()
    return 1 if print_report(report, config) else 0


if __name__ == "__main__":
    sys.exit(main())
