"""The worker supervisor of ``tandem serve``: restarts with backoff, groups, stop."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from tandem_cli.supervisor import Backoff, WorkerSupervisor
from tandem_testing.cells import running_cell

CTX = multiprocessing.get_context("spawn")


class Starter:
    """Starts sleeping processes and records which ranks each call started."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, ranks: range) -> list[BaseProcess]:
        self.calls.append(list(ranks))
        procs = [CTX.Process(target=time.sleep, args=(60,), name=f"w{r}") for r in ranks]
        for p in procs:
            p.start()
        return procs


def _wait(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_backoff_doubles_up_to_the_maximum() -> None:
    b = Backoff(initial=0.5, maximum=4.0)
    assert [b.delay(n) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_killed_worker_is_restarted_with_growing_delay() -> None:
    starter = Starter()
    sup = WorkerSupervisor(starter, 2, backoff=Backoff(initial=0.2, maximum=5.0),
                           poll_s=0.02)
    sup.start()
    try:
        sup.check_invariants()
        delays = []
        for _ in range(2):
            victim = sup.processes[1]
            killed = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)
            _wait(lambda v=victim: sup.processes[1] is not v and sup.processes[1].is_alive())
            delays.append(time.monotonic() - killed)
            sup.check_invariants()
        assert starter.calls == [[0], [1], [1], [1]]  # rank 0 was never touched
        assert 0.2 <= delays[0] < delays[1] and delays[1] >= 0.4
        assert sup.restarts == 2
    finally:
        sup.stop()
    assert not any(p.is_alive() for p in sup.processes)


def test_a_group_restarts_together_and_stop_ends_restarts() -> None:
    starter = Starter()
    sup = WorkerSupervisor(starter, 2, group_size=2, backoff=Backoff(initial=0.1),
                           poll_s=0.02)
    sup.start()
    first = sup.processes
    os.kill(first[0].pid, signal.SIGKILL)
    _wait(lambda: all(p not in first and p.is_alive() for p in sup.processes))
    assert starter.calls == [[0, 1], [0, 1]]
    assert not first[1].is_alive(), "the surviving rank of a broken group is stopped too"
    sup.stop()
    os_pids = [p.pid for p in sup.processes]
    time.sleep(0.3)
    assert starter.calls == [[0, 1], [0, 1]] and [p.pid for p in sup.processes] == os_pids
    assert not any(p.is_alive() for p in sup.processes)


def test_groups_must_divide_the_workers() -> None:
    with pytest.raises(ValueError):
        WorkerSupervisor(Starter(), 3, group_size=2)


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie no one reaps (its parent was killed)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_the_workers_stop_when_tandem_serve_is_killed(tmp_path: Path) -> None:
    """SIGKILL gives ``tandem serve`` no stop of its own: its workers get the parent-death
    signal instead (they were left running, orphans holding the segment)."""
    with running_cell(tmp_path) as cell:
        workers = _children(cell.proc.pid)
        assert workers, "tandem serve has a worker process"
        os.kill(cell.proc.pid, signal.SIGKILL)
        cell.proc.wait()
        _wait(lambda: all(_gone(w) for w in workers))
