"""Restarts the worker processes of ``tandem serve`` that exit while the cell is serving.

Why: a local cell is one scheduler and N worker processes. Without a supervisor, one worker
killed by the OOM killer or a crash leaves the scheduler NOT_SERVING for good. On
Kubernetes the kubelet restarts a worker pod; this is the same policy for the local pair:
restart with exponential backoff, and reset the backoff once a process stayed up a while.

Workers that form one torch.distributed world (tensor parallelism) fail and restart as a
group: one rank cannot rejoin a process group alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before restart n (0-based): ``initial * 2**n``, at most ``maximum`` seconds.

    A group that ran at least ``stable_after`` seconds before failing starts over at n = 0.
    """

    initial: float = 0.5
    maximum: float = 30.0
    stable_after: float = 60.0

    def delay(self, failures: int) -> float:
        return min(self.maximum, self.initial * 2 ** min(failures, 30))


@dataclass(slots=True)
class _Group:
    ranks: range
    procs: list[BaseProcess]
    started: float
    failures: int = 0  # consecutive quick failures, for the backoff
    restart_at: float | None = None  # set while a restart is pending


class WorkerSupervisor:
    """Keeps one live process per worker rank until :meth:`stop`.

    ``start_group(ranks)`` returns one started process per rank of ``ranks`` (fresh ones
    for every call, e.g. with a new rendezvous port).

    Invariants: every rank belongs to exactly one group (consecutive ranks of
    ``group_size``); a group has one process per rank; a group is either running (all its
    processes started, ``restart_at`` None) or waiting to restart (``restart_at`` set, its
    processes stopped). Only the supervisor thread mutates groups after :meth:`start`,
    under ``_lock``.
    """

    def __init__(self, start_group: Callable[[range], list[BaseProcess]], num_workers: int,
                 group_size: int = 1, backoff: Backoff | None = None,
                 poll_s: float = 0.1) -> None:
        if num_workers < 1 or group_size < 1 or num_workers % group_size:
            raise ValueError(f"{num_workers} workers cannot form groups of {group_size}")
        self._start_group = start_group
        self._backoff = backoff or Backoff()
        self._poll_s = poll_s
        self._groups = [_Group(range(g, g + group_size), [], 0.0)
                        for g in range(0, num_workers, group_size)]
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.restarts = 0  # groups restarted since start

    @property
    def processes(self) -> list[BaseProcess]:
        with self._lock:
            return [p for g in self._groups for p in g.procs]

    def start(self) -> None:
        """Start every worker, then watch them from a daemon thread."""
        with self._lock:
            for group in self._groups:
                self._launch(group)
        self._thread = threading.Thread(target=self._watch, name="worker-supervisor",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """No more restarts; terminate every worker, join with ``timeout``, kill the rest."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            stop_processes([p for g in self._groups for p in g.procs], timeout)

    def _watch(self) -> None:
        while not self._stopping.wait(self._poll_s):
            with self._lock:
                for group in self._groups:
                    self._tend(group, time.monotonic())

    def _tend(self, group: _Group, now: float) -> None:
        if group.restart_at is not None:
            if now >= group.restart_at and not self._stopping.is_set():
                self.restarts += 1
                self._launch(group)
            return
        dead = [p for p in group.procs if not p.is_alive()]
        if not dead:
            return
        if now - group.started >= self._backoff.stable_after:
            group.failures = 0
        delay = self._backoff.delay(group.failures)
        group.failures += 1
        log.warning("worker %s (pid %s) exited with code %s; restarting ranks %d..%d in %.1f s",
                    dead[0].name, dead[0].pid, dead[0].exitcode, group.ranks[0],
                    group.ranks[-1], delay)
        stop_processes(group.procs, timeout=5.0)  # the rest of a broken group
        group.restart_at = now + delay

    def _launch(self, group: _Group) -> None:
        group.procs = self._start_group(group.ranks)
        group.started = time.monotonic()
        group.restart_at = None

    def check_invariants(self) -> None:
        with self._lock:
            ranks = [r for g in self._groups for r in g.ranks]
            assert ranks == list(range(len(ranks))), ranks
            for g in self._groups:
                assert len(g.procs) == len(g.ranks), g
                if g.restart_at is None:
                    assert all(p.pid is not None for p in g.procs), g


def stop_processes(procs: list[BaseProcess], timeout: float = 10.0) -> None:
    """terminate -> join with a timeout -> kill."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        if p.pid is None:
            continue
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
