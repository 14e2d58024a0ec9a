"""``--shutdown-grace`` (issue 22, item 6): SIGTERM lets running streams finish for as long
as the setting says, no longer the hard-coded 5 s that cut longer streams when Kubernetes
stopped a pod.

The scheduler and its workers get SIGTERM at the same moment, as when Kubernetes stops a
cell's pods together: the workers must keep running the stopping scheduler's steps.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from tandem.v1 import generate_pb2
from tandem_testing.cells import Cell, request, running_cell

OLD_GRACE_S = 5.0  # what every process allowed before the setting
PAUSE_S = OLD_GRACE_S + 1.5  # the workers are stopped this long right after SIGTERM
FLAGS = ("--kv-cache-size", "64Mi")


@contextmanager
def _stream_then_sigterm(cell: Cell) -> Iterator[tuple[Iterator[generate_pb2.GenerateResponse],
                                                       int, int, float]]:
    """A stream with its first message read, then SIGTERM to the scheduler and its workers
    at once: (the stream, its max_tokens, tokens read, when). The workers are stopped for
    PAUSE_S right after the signal (well inside the step timeout), so however fast this
    machine runs the stream, it cannot end within the old grace; they are always resumed."""
    n = 64
    stream = cell.stub.Generate(request("Keep going", max_tokens=n, ignore_eos=True),
                                timeout=120)
    tokens = len(next(stream).token_ids)
    workers = cell.worker_pids()
    assert workers
    sent = time.monotonic()
    for pid in (cell.proc.pid, *workers):
        os.kill(pid, signal.SIGTERM)
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(PAUSE_S, lambda: [os.kill(pid, signal.SIGCONT) for pid in workers])
    resume.start()
    try:
        yield stream, n, tokens, sent
    finally:
        resume.join()


def test_a_stream_longer_than_the_old_grace_finishes_after_sigterm(tmp_path: Path) -> None:
    with (running_cell(tmp_path, "--shutdown-grace", "60", *FLAGS) as cell,
          _stream_then_sigterm(cell) as (stream, n, tokens, sent)):
        last = None
        for last in stream:
            tokens += len(last.token_ids)
        ran = time.monotonic() - sent
        assert tokens == n and last is not None
        assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert ran > OLD_GRACE_S, f"the stream ended {ran:.1f} s after SIGTERM"
        assert cell.proc.wait(30) == 0


def test_a_grace_shorter_than_the_stream_cuts_it(tmp_path: Path) -> None:
    with (running_cell(tmp_path, "--shutdown-grace", "0.5", *FLAGS) as cell,
          _stream_then_sigterm(cell) as (stream, n, tokens, sent)):
        with pytest.raises(grpc.RpcError):
            for msg in stream:
                tokens += len(msg.token_ids)
        assert time.monotonic() - sent < OLD_GRACE_S, "cut long after the 0.5 s grace"
        assert tokens < n
        assert cell.proc.wait(30) == 0
