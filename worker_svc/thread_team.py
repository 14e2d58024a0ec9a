"""The worker's torch thread team, sized at run time to the CPUs it really gets.

The thread budget (``--torch-threads``, by default every CPU the process may use:
:func:`tandem.cpus.usable_cpus`) assumes those CPUs are free. When another job holds one,
an OpenMP team as large as the budget loses most of its time: every parallel region waits
at its barrier for the thread that shares a core with the other job, so two threads beside
one spinning process decode at ~0.4x of their quiet rate where one thread keeps ~1.0x
(docs/benchmarks.md, "Beside a CPU hog"). A smaller team is slower on a quiet machine
(prefill, batches), and a busy core is not always another job's (the cell's own scheduler
and clients share the node), so the size is tried rather than guessed:

* **suspect** a core taken when, for a few windows in a row, the team's threads spend a
  large share of their runnable time waiting for a CPU (their run-queue delay,
  ``/proc/self/task/<tid>/schedstat``); **try** one thread fewer for a window and keep it
  only if steps of the same shape (scheduled tokens, requests) got faster by a clear
  margin;
* when the team is below the budget and the CPUs of the process's affinity set have had a
  CPU's worth of idle time (``/proc/stat``) for a few windows in a row, try one thread
  more and keep it unless those steps got slower.

A trial that is undone, or a grow undone by a shrink soon after, doubles the windows the
next trial in that direction waits for (up to a bound), so a core busy in bursts does not
make the team flap. The step thread calls :meth:`ThreadTeam.after_step` after each step: a
window closes at the first step end after ``window_s``, and only windows the worker
stepped through for the most part count as evidence (an idle worker's threads wait for
nothing). ``torch.set_num_threads`` is called there, on the step thread: OpenMP's team size
is a setting of the thread that starts the parallel regions (``omp_set_num_threads``), and
torch sets it (and MKL's) for the calling thread. Without ``/proc`` (not Linux) the team
stays the budget; without run-delay accounting it never suspects a taken core.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import torch

log = logging.getLogger(__name__)

PROC = Path("/proc")

Shape = tuple[int, int]  # a step's scheduled tokens and requests
Steps = Mapping[Shape, list[float]]  # shape -> the seconds each step of that shape took


def merge_steps(into: dict[Shape, list[float]], steps: Steps) -> None:
    for shape, seconds in steps.items():
        into.setdefault(shape, []).extend(seconds)


@dataclass(frozen=True)
class Window:
    """What the team saw over one window of steps."""

    wall_s: float  # the window's length
    busy_s: float  # of it, time the step thread spent in steps
    ran_s: float  # the team's threads on a CPU (OpenMP threads spinning at a barrier too)
    waited_s: float  # the team's threads runnable but waiting for a CPU (run-queue delay)
    idle_cpus: float  # CPUs of the affinity set idle on average (idle CPU-seconds / wall_s)
    steps: Steps = field(default_factory=dict)  # the steps that ended in it, by shape

    @property
    def waiting(self) -> float:
        """Share of the team's runnable time spent waiting for a CPU."""
        runnable = self.ran_s + self.waited_s
        return self.waited_s / runnable if runnable > 0 else 0.0


def time_ratio(trial: Steps, baseline: Steps, least: int) -> float | None:
    """Time the trial's steps took over the time steps of the same shapes took before, each
    shape at its median (a slow first step of a shape is no evidence) and in the trial's
    numbers; steps without tokens (releases only) do not count, nor shapes the baseline
    saw once (a prompt's prefill: its one step may be the first of its size, which pays
    for the GEMM primitives of that size). None when fewer than ``least`` of the trial's
    steps have a match."""
    matched = [(len(ts), median(ts), median(baseline[k])) for k, ts in trial.items()
               if k[0] > 0 and len(baseline.get(k, ())) > 1]
    if sum(n for n, _, _ in matched) < least:
        return None
    return sum(n * t for n, t, _ in matched) / sum(n * b for n, _, b in matched)


@dataclass
class _Trial:
    by: int  # -1: one thread fewer; +1: one more
    baseline: dict[Shape, list[float]]  # steps at the size before
    seen: dict[Shape, list[float]] = field(default_factory=dict)
    windows: int = 0


class TeamPolicy:
    """The team size, judged window by window (pure: no clock, no /proc).

    ``suspect_waiting``: the share of runnable time spent waiting above which a window
    counts towards trying a smaller team; ``grow_idle``: the idle CPUs above which it counts
    towards trying a larger one (a CPU mostly free for one more thread); ``min_busy``: the
    share of a window the worker must have stepped for it to count; ``gain``: the margin by
    which a smaller team must be faster to be kept, and a larger one may not be slower.
    ``shrink_windows`` / ``grow_windows``: the evidence a trial waits for (doubled after
    each undone one, at most ``max_windows``); a trial lasts until ``least_steps`` of its
    steps match earlier ones in shape, at most ``trial_windows`` windows.
    """

    def __init__(self, budget: int, *, suspect_waiting: float = 0.15, grow_idle: float = 0.5,
                 min_busy: float = 0.5, gain: float = 0.1, shrink_windows: int = 2,
                 grow_windows: int = 3, max_windows: int = 16, trial_windows: int = 3,
                 least_steps: int = 3) -> None:
        if budget < 1:
            raise ValueError(f"a thread budget must be at least 1, not {budget}")
        self.budget = self.size = budget
        self.suspect_waiting, self.grow_idle = suspect_waiting, grow_idle
        self.min_busy, self.gain = min_busy, gain
        self.base = {-1: shrink_windows, +1: grow_windows}
        self.needed = dict(self.base)  # windows of evidence before the next trial, by direction
        self.max_windows, self.trial_windows, self.least_steps = (max_windows, trial_windows,
                                                                  least_steps)
        self.last_ratio: float | None = None  # the last trial's time ratio (for the log)
        self._runs = {-1: 0, +1: 0}  # consecutive windows of evidence, by direction
        # the steps of the last windows of each run of evidence: a trial's baseline
        self._evidence: dict[int, deque[Steps]] = {-1: deque(maxlen=3), +1: deque(maxlen=3)}
        self._trial: _Trial | None = None
        self._since_grow: int | None = None  # windows since a larger team was kept

    @property
    def trying(self) -> bool:
        """A size is on trial."""
        return self._trial is not None

    def decide(self, w: Window) -> int:
        """The team size after window ``w``."""
        if self._since_grow is not None:
            self._since_grow += 1
        if self._trial is not None:
            self._judge(self._trial, w)
            return self.size
        counts = w.wall_s > 0 and w.busy_s >= self.min_busy * w.wall_s
        shrink = counts and self.size > 1 and w.waiting >= self.suspect_waiting
        grow = (counts and not shrink and self.size < self.budget
                and w.idle_cpus >= self.grow_idle)
        for by, evidence in ((-1, shrink), (+1, grow)):
            self._runs[by] = self._runs[by] + 1 if evidence else 0
            if evidence:
                self._evidence[by].append(w.steps)
            else:
                self._evidence[by].clear()
            if self._runs[by] >= self.needed[by]:
                # Each shape's steps from the newest window that has it: the first window of
                # a run may straddle the change (a hog starting), its early steps as fast as
                # before, and mixed in they would make the baseline the quiet one.
                baseline: dict[Shape, list[float]] = {}
                for steps in reversed(self._evidence[by]):
                    for shape, seconds in steps.items():
                        baseline.setdefault(shape, list(seconds))
                self._trial = _Trial(by, baseline)
                self.size += by
                self._runs = {-1: 0, +1: 0}
                for seen in self._evidence.values():
                    seen.clear()
                break
        return self.size

    def _judge(self, t: _Trial, w: Window) -> None:
        merge_steps(t.seen, w.steps)
        t.windows += 1
        ratio = time_ratio(t.seen, t.baseline, self.least_steps)
        if ratio is None and t.windows < self.trial_windows:
            return  # too few steps like the earlier ones yet
        self._trial, self.last_ratio = None, ratio
        keep = ratio is not None and (ratio <= 1 - self.gain if t.by < 0
                                      else ratio < 1 + self.gain)
        if not keep:
            self.size -= t.by
            self.needed[t.by] = min(2 * self.needed[t.by], self.max_windows)
            return
        if t.by > 0:
            self._since_grow = 0
            return
        self.needed[-1] = self.base[-1]
        if self._since_grow is not None and self._since_grow <= 2 * self.needed[+1]:
            # a larger team undone soon after: the core it took is busy in bursts
            self.needed[+1] = min(2 * self.needed[+1], self.max_windows)
        else:
            self.needed[+1] = self.base[+1]


@dataclass(frozen=True)
class Reading:
    """Cumulative counters at one instant."""

    at: float  # time.monotonic()
    threads: dict[int, tuple[int, int]]  # tid -> (ns on a CPU, ns waiting for one)
    idle_s: float  # idle seconds of the affinity set's CPUs since boot


class ProcReader:
    """Reads :class:`Reading` from ``/proc`` (Linux): each thread's ``schedstat`` (on-CPU
    ns, run-queue ns, timeslices) and the ``cpuN`` lines of ``/proc/stat`` (idle and iowait
    in clock ticks) for the CPUs this process may run on."""

    def __init__(self, proc: Path = PROC, cpus: Iterable[int] | None = None) -> None:
        self.proc = proc
        self.cpus = {f"cpu{c}" for c in (os.sched_getaffinity(0) if cpus is None else cpus)}
        self.tick_s = 1 / os.sysconf("SC_CLK_TCK")

    def read(self, skip: set[int]) -> Reading:
        """This process's threads but those in ``skip``, and the CPUs' idle time. Raises
        OSError or ValueError when ``/proc`` has no such files."""
        threads = {}
        task = self.proc / "self" / "task"
        for name in os.listdir(task):
            tid = int(name)
            if tid in skip:
                continue
            try:
                ran, waited = (task / name / "schedstat").read_text().split()[:2]
            except (FileNotFoundError, ProcessLookupError):
                continue  # the thread ended since the listing
            threads[tid] = (int(ran), int(waited))
        idle = 0
        with open(self.proc / "stat") as stat:
            for line in stat:
                if not line.startswith("cpu"):
                    break  # the cpu lines come first
                fields = line.split()
                if fields[0] in self.cpus:
                    idle += int(fields[4]) + int(fields[5])  # idle, iowait
        return Reading(time.monotonic(), threads, idle * self.tick_s)


def window_between(a: Reading, b: Reading, steps: Steps) -> Window:
    """The window from reading ``a`` to ``b`` with ``steps``; a thread that started since
    counts whole."""
    ran = waited = 0
    for tid, (r, w) in b.threads.items():
        r0, w0 = a.threads.get(tid, (0, 0))
        ran, waited = ran + r - r0, waited + w - w0
    wall = b.at - a.at
    return Window(wall_s=wall, busy_s=sum(map(sum, steps.values())), ran_s=ran / 1e9,
                  waited_s=waited / 1e9, idle_cpus=(b.idle_s - a.idle_s) / max(wall, 1e-9),
                  steps=steps)


def _other_python_threads() -> set[int]:
    """Native ids of this process's Python threads but the caller (the event loop, the
    executor's idle threads): not the team. The team is the step thread and OpenMP's."""
    me = threading.get_native_id()
    return {t.native_id for t in threading.enumerate() if t.native_id not in (None, me)}


class ThreadTeam:
    """The step thread's torch team: the budget, or (``adaptive``) sized by :class:`TeamPolicy`
    from :class:`ProcReader`'s readings. Its methods run on the step thread only; ``size``
    is read from the event loop (a single int)."""

    def __init__(self, budget: int, adaptive: bool, *, window_s: float = 1.0,
                 reader: Callable[[set[int]], Reading] | None = None,
                 policy: TeamPolicy | None = None,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 rank: int = 0) -> None:
        self.policy = policy or TeamPolicy(budget)
        self.budget = self.size = budget
        self.window_s = window_s
        self.rank = rank
        self._read = reader or ProcReader().read
        self._set_threads = set_threads
        self.adaptive = adaptive and budget > 1  # off for good if /proc cannot be read
        self._start: Reading | None = None
        self._steps: dict[Shape, list[float]] = {}
        self._before_trial = budget

    def after_step(self, step_s: float, shape: Shape) -> None:
        """A step of ``step_s`` seconds and ``shape`` ended; at a window's end, resize."""
        if not self.adaptive:
            return
        self._steps.setdefault(shape, []).append(step_s)
        if self._start is not None and time.monotonic() - self._start.at < self.window_s:
            return
        try:
            now = self._read(_other_python_threads())
        except (OSError, ValueError) as exc:
            log.warning("worker %d: CPU readings unavailable (%s); the torch team stays at "
                        "its budget of %d threads", self.rank, exc, self.budget)
            self.adaptive = False
            self._resize(self.budget)
            return
        if self._start is not None:
            window = window_between(self._start, now, self._steps)
            trying = self.policy.trying
            size = self.policy.decide(window)
            log.debug("worker %d: %.2f s window, %.2f s stepping, waiting %.0f%% of runnable "
                      "time, %.1f CPUs idle; %d -> %d threads", self.rank, window.wall_s,
                      window.busy_s, 100 * window.waiting, window.idle_cpus, self.size, size)
            if self.policy.trying and not trying:
                self._before_trial = self.size
                log.debug("worker %d: trying %d torch threads (waiting %.0f%% of runnable "
                          "time, %.1f CPUs idle)", self.rank, size, 100 * window.waiting,
                          window.idle_cpus)
            elif trying and not self.policy.trying and size != self._before_trial:
                log.info("worker %d: torch team %d -> %d threads (steps alike took %s the "
                         "time)", self.rank, self._before_trial, size,
                         _ratio(self.policy.last_ratio))
            elif trying and not self.policy.trying:
                log.debug("worker %d: torch team stays at %d threads (steps alike took %s "
                          "the time with %d)", self.rank, size,
                          _ratio(self.policy.last_ratio), self.size)
            self._resize(size)
        self._start, self._steps = now, {}

    def _resize(self, size: int) -> None:
        if size != self.size:
            self._set_threads(size)
            self.size = size

    def metric_values(self) -> dict[str, float]:
        return {"tandem_torch_threads": self.size}


def _ratio(ratio: float | None) -> str:
    return "?" if ratio is None else f"{ratio:.2f}x"
