"""``--shutdown-grace`` (issue 22, item 6): SIGTERM lets running streams finish for as long
as the setting says, no longer the hard-coded 5 s that cut longer streams when Kubernetes
stopped a pod.

The scheduler and its workers get SIGTERM at the same moment, as when Kubernetes stops a
cell's pods together: the workers must keep running the stopping scheduler's steps.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem.v1 import generate_pb2
from tandem_testing.cells import Cell, request, running_cell

OLD_GRACE_S = 5.0  # what every process allowed before the setting
AFTER_SIGTERM_S = 8.0  # how long the stream should still run after SIGTERM
MAX_TOKENS = 4000  # under tiny's 4096 positions
FLAGS = ("--max-tokens-limit", str(MAX_TOKENS), "--kv-cache-size", "64Mi")


def _tokens_for(cell: Cell, seconds: float) -> int:
    """max_tokens of a stream that runs about ``seconds`` on this machine, now."""
    start = time.monotonic()
    cell.generate("warm up", max_tokens=64, ignore_eos=True)
    per_token = (time.monotonic() - start) / 64
    n = int(seconds / per_token)
    if n > MAX_TOKENS:
        pytest.skip(f"{per_token * 1e3:.2f} ms per token: no stream of {MAX_TOKENS} tokens "
                    f"outlasts the old {OLD_GRACE_S} s grace here")
    return n


def _stream_then_sigterm(cell: Cell) -> tuple[Iterator[generate_pb2.GenerateResponse],
                                              int, int, float]:
    """A stream that runs past AFTER_SIGTERM_S, its first message read, then SIGTERM to the
    scheduler and its workers at once: (the stream, its max_tokens, tokens read, when)."""
    n = _tokens_for(cell, AFTER_SIGTERM_S + 1.0)
    stream = cell.stub.Generate(request("Keep going", max_tokens=n, ignore_eos=True),
                                timeout=120)
    tokens = len(next(stream).token_ids)
    workers = cell.worker_pids()
    assert workers
    sent = time.monotonic()
    for pid in (cell.proc.pid, *workers):
        os.kill(pid, signal.SIGTERM)
    return stream, n, tokens, sent


def test_a_stream_longer_than_the_old_grace_finishes_after_sigterm(tmp_path: Path) -> None:
    with running_cell(tmp_path, "--shutdown-grace", "60", *FLAGS) as cell:
        stream, n, tokens, sent = _stream_then_sigterm(cell)
        last = None
        for last in stream:
            tokens += len(last.token_ids)
        ran = time.monotonic() - sent
        assert tokens == n and last is not None
        assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert ran > OLD_GRACE_S, f"the stream ended {ran:.1f} s after SIGTERM: too short a test"
        assert cell.proc.wait(30) == 0


def test_a_grace_shorter_than_the_stream_cuts_it(tmp_path: Path) -> None:
    with running_cell(tmp_path, "--shutdown-grace", "0.5", *FLAGS) as cell:
        stream, n, tokens, sent = _stream_then_sigterm(cell)
        with pytest.raises(grpc.RpcError):
            for msg in stream:
                tokens += len(msg.token_ids)
        assert time.monotonic() - sent < OLD_GRACE_S, "cut long after the 0.5 s grace"
        assert tokens < n
        assert cell.proc.wait(30) == 0
