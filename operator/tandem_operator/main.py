"""`tandem operator`: run the kopf operator with Tandem's defaults.

Same handlers as `kopf run -m tandem_operator`; this entry point only picks the defaults a
deployment wants: all namespaces, standalone (one replica, no peering), a liveness endpoint.
"""

from __future__ import annotations

import argparse

import kopf

import tandem_operator  # noqa: F401  (registers the handlers)
from tandem import tracing


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem operator", description=__doc__)
    p.add_argument("-n", "--namespace", action="append", default=[],
                   help="serve only this namespace (repeatable; default: all namespaces)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                   help="kopf liveness endpoint URL ('' = none)")
    p.add_argument("--peering", default=None,
                   help="kopf peering name; without it the operator runs standalone")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--debug", action="store_true")
    return p


def run(argv: list[str] | None = None) -> int:
    """Run the operator until it is stopped (SIGINT/SIGTERM); returns the exit status."""
    args = parser().parse_args(argv)
    kopf.configure(verbose=args.verbose, debug=args.debug)
    tracing.setup("tandem-operator")  # on only when OTEL_* / TANDEM_TRACE_FILE say so
    try:
        kopf.run(
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            standalone=args.peering is None,
            peering_name=args.peering,
            liveness_endpoint=args.liveness or None,
        )
    finally:
        tracing.shutdown()
    return 0
