"""The soak workload (bench/soak.py runs it at full length, tests/test_soak.py shortened).

Load: ``--concurrency`` client threads; each request takes one of a few shared prompt
prefixes, 0-2 images drawn from a pool with Zipf-like reuse (image k has weight 1/(k+1)^s),
and a few output tokens; ``--cancel`` of the streams are cancelled by the client after a
random number of messages, and ``--retry-same-id`` of those are sent again at once with the
same ``request_id`` (a proxy retrying with its ``x-request-id``): the retry must end OK,
never as a duplicate or an internal error. Two faults: when ``--stop-at`` of the requests
are done, the worker is stopped (SIGSTOP) for ``--stop-for`` seconds, longer than the cell's
step timeout, then continued (SIGCONT): alive all along, so its reader slot must not be
touched while its timed-out step may still run; when ``--restart-at`` are done, it is killed
with SIGKILL and ``tandem serve`` restarts it. Clients retry UNAVAILABLE with backoff, as a
real client would. The cell runs with ``TANDEM_DEBUG_INVARIANTS=1``: after every step the
delivery ledger is checked against the segment's counters.

Pass criteria (exit status 1 otherwise), printed with every count:

* zero unexpected statuses: OK, client CANCELLED, and UNAVAILABLE between a fault and the
  cell being ready again (plus a second) are the only ones allowed;
* at the end, idle: ``shm_unacked_refs`` 0 and equal to the ledger's references, every
  KV block free, no error caught by the engine loop (a failed ledger check is one);
* RSS flat after warm-up: the scheduler's RSS at the end is within ``--rss-slack`` of its
  RSS after the warm-up (the first ``--warmup`` of the requests), and the restarted
  worker's likewise from its own warm-up.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tandem_testing.cells import Cell, png, request

PREFIXES = [
    "You are a careful assistant. Describe what you see and answer briefly. ",
    "System: answer in one sentence, in plain words, without lists. ",
    "Context: a photo archive of a small museum; every image has a caption. ",
    "Translate the question into a short answer about the picture. ",
]
QUESTIONS = ["What is it?", "Which colours?", "How many?", "Where is this?", "Why?"]
MiB = 1 << 20


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 3000
    concurrency: int = 16
    images: int = 48
    zipf: float = 1.1
    cancel: float = 0.05
    retry_same_id: float = 0.5  # fraction of cancelled streams retried at once, same id
    restart_at: float = 0.5  # fraction of requests done when the worker is killed; 0 = never
    stop_at: float = 0.25  # fraction done when the worker is stopped (SIGSTOP); 0 = never
    stop_for: float = 6.0  # seconds stopped; more than step_timeout
    # The cell's --step-timeout: above the slowest step of this load on a loaded 2-core
    # machine (a first batch of 16 prefills with images, or the step a stopped worker
    # still runs after SIGCONT, which the next one waits behind; 2 s was too short).
    step_timeout: float = 5.0
    warmup: float = 0.2  # fraction of requests before the first RSS reading
    max_tokens: int = 12
    rss_slack: float = 0.10  # allowed RSS growth after warm-up (fraction; at least 16 MiB)
    seed: int = 0


@dataclass
class SoakReport:
    statuses: Counter[str] = field(default_factory=Counter)  # every attempt's outcome
    unexpected: list[str] = field(default_factory=list)
    retries: int = 0
    same_id_retries: int = 0  # cancelled streams sent again with their request_id
    tokens: int = 0
    elapsed: float = 0.0
    restart_window: tuple[float, float] | None = None  # kill -> ready again (monotonic)
    stop_window: tuple[float, float] | None = None  # SIGSTOP -> ready again (monotonic)
    rss: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # process -> readings
    end: dict[str, float] = field(default_factory=dict)  # final CacheStats and metrics

    def failures(self, config: SoakConfig) -> list[str]:
        out = list(self.unexpected)
        if self.end.get("shm_unacked_refs", 0) != 0:
            out.append(f"shm_unacked_refs {self.end['shm_unacked_refs']:.0f} at the end")
        if self.end.get("shm_ledger_refs", 0) != self.end.get("shm_unacked_refs", 0):
            out.append(f"ledger refs {self.end.get('shm_ledger_refs'):.0f} != shm_unacked_refs "
                       f"{self.end.get('shm_unacked_refs'):.0f}")
        if self.end.get("engine_errors_total", 0):
            out.append(f"{self.end['engine_errors_total']:.0f} errors caught by the engine loop "
                       "(a failed invariant check is one: see the cell log)")
        if self.end.get("kv_blocks_free") != self.end.get("kv_blocks_total"):
            out.append(f"KV blocks free {self.end.get('kv_blocks_free')} of "
                       f"{self.end.get('kv_blocks_total')} at the end")
        for name, readings in self.rss.items():
            if len(readings) >= 2:
                start, end = readings[0][1], readings[-1][1]
                if end - start > max(config.rss_slack * start, 16 * MiB):
                    out.append(f"{name} RSS grew {start / MiB:.0f} -> {end / MiB:.0f} MiB")
        return out


class Soak:
    """Runs the load against ``cell``; one instance per run."""

    def __init__(self, cell: Cell, config: SoakConfig, metrics_port: int) -> None:
        self.cell, self.config, self.metrics_port = cell, config, metrics_port
        rng = random.Random(config.seed)
        sides = [56, 84, 112, 168, 224]
        self.pool = [png(1000 + k, rng.choice(sides), rng.choice(sides))
                     for k in range(config.images)]
        self.weights = [1 / (k + 1) ** config.zipf for k in range(config.images)]
        self.report = SoakReport()
        self._lock = threading.Lock()
        self._next = 0
        self._done = 0
        self._faults: list[tuple[float, float | None]] = []  # (start, ready again) of each
        self._threads: list[threading.Thread] = []

    def run(self) -> SoakReport:
        start = time.monotonic()
        threads = [threading.Thread(target=self._client, args=(i,), name=f"soak-{i}")
                   for i in range(self.config.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.report.elapsed = time.monotonic() - start
        for t in self._threads:
            t.join()
        self._read_rss("end")
        self.report.end = self._end_state()
        return self.report

    # -- load ---------------------------------------------------------------------------

    def _client(self, index: int) -> None:
        rng = random.Random(self.config.seed * 1000 + index)
        while (n := self._take()) is not None:
            msg, cancel_after = self._request(rng, n)
            retry = cancel_after is not None and rng.random() < self.config.retry_same_id
            if retry:
                msg.request_id = f"soak-{self.config.seed}-{n}"
            self._until_answered(msg, cancel_after)
            if retry:  # at once, with the same id: the cancel may still be landing
                with self._lock:
                    self.report.same_id_retries += 1
                self._until_answered(msg, None)
            self._finished()

    def _until_answered(self, msg, cancel_after: int | None) -> None:
        """Attempts until one is not UNAVAILABLE, with backoff."""
        delay = 0.05
        while not self._attempt(msg, cancel_after):
            with self._lock:
                self.report.retries += 1
            time.sleep(delay)
            delay = min(1.0, delay * 2)

    def _take(self) -> int | None:
        with self._lock:
            if self._next >= self.config.requests:
                return None
            self._next += 1
            return self._next - 1

    def _request(self, rng: random.Random, n: int):
        images = [self.pool[k] for k in rng.choices(range(len(self.pool)), self.weights,
                                                   k=rng.choice((0, 1, 1, 2)))]
        prompt = (rng.choice(PREFIXES) + " ".join("<image>" for _ in images) + " "
                  + rng.choice(QUESTIONS) + f" #{n % 97}")
        msg = request(prompt, images, max_tokens=rng.randint(1, self.config.max_tokens),
                      ignore_eos=rng.random() < 0.5, temperature=rng.choice((0.0, 0.8)),
                      seed=n)
        cancel_after = rng.randint(0, 3) if rng.random() < self.config.cancel else None
        return msg, cancel_after

    def _attempt(self, msg, cancel_after: int | None) -> bool:
        """One call; False when it should be retried (UNAVAILABLE)."""
        stream = self.cell.stub.Generate(msg, timeout=120)
        tokens = 0
        try:
            for k, out in enumerate(stream):
                tokens += len(out.token_ids)
                if cancel_after is not None and k >= cancel_after:
                    stream.cancel()
            status = "OK"
        except grpc.RpcError as exc:
            status = exc.code().name
        if status == "CANCELLED" and cancel_after is None:
            status = "CANCELLED (not by the client)"
        with self._lock:
            self.report.statuses[status] += 1
            self.report.tokens += tokens
            if status == "UNAVAILABLE" and not self._in_fault_window():
                self.report.unexpected.append(f"UNAVAILABLE outside a fault window at "
                                              f"{time.monotonic():.1f}")
            elif status not in ("OK", "CANCELLED", "UNAVAILABLE"):
                self.report.unexpected.append(status)
        return status != "UNAVAILABLE"

    def _in_fault_window(self) -> bool:
        """Called under the lock: a fault started and its cell was ready again < 1 s ago."""
        now = time.monotonic()
        return any(begin <= now and (end is None or now <= end + 1.0)
                   for begin, end in self._faults)

    def _finished(self) -> None:
        with self._lock:
            self._done += 1
            done = self._done
        total = self.config.requests
        if done == max(1, int(total * self.config.warmup)):
            self._read_rss("warm")
        for at, fault in ((self.config.stop_at, self._stop_worker),
                          (self.config.restart_at, self._restart_worker)):
            if at and done == int(total * at):
                thread = threading.Thread(target=fault, name=f"soak-{fault.__name__}")
                self._threads.append(thread)
                thread.start()

    # -- the fault ----------------------------------------------------------------------

    def _stop_worker(self) -> None:
        """SIGSTOP past the step timeout, then SIGCONT: a slow but live worker."""
        (pid,) = self.cell.worker_pids()
        index = self._fault_started()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(self.config.stop_for)
        finally:
            os.kill(pid, signal.SIGCONT)
        self._wait_ready(lambda: True)
        self.report.stop_window = self._fault_ended(index)

    def _restart_worker(self) -> None:
        (pid,) = self.cell.worker_pids()
        index = self._fault_started()
        os.kill(pid, signal.SIGKILL)
        self._wait_ready(lambda: (new := self.cell.worker_pids()) != [] and new != [pid])
        self.report.restart_window = self._fault_ended(index)
        self.report.rss.pop("worker", None)  # a new process: its own warm-up reading
        time.sleep(2.0)
        self._read_rss("worker warm", only="worker")

    def _fault_started(self) -> int:
        with self._lock:
            self._faults.append((time.monotonic(), None))
            return len(self._faults) - 1

    def _fault_ended(self, index: int) -> tuple[float, float]:
        with self._lock:
            begin, _ = self._faults[index]
            self._faults[index] = (begin, time.monotonic())
            return self._faults[index]  # type: ignore[return-value]

    def _wait_ready(self, worker_ok: Callable[[], bool]) -> None:
        """Until the cell is ready again (and ``worker_ok``: e.g. a new worker process)."""
        while True:
            time.sleep(0.05)
            try:
                if worker_ok() and self.cell.health() == 1:
                    return
            except grpc.RpcError:
                pass

    # -- readings -----------------------------------------------------------------------

    def _read_rss(self, label: str, only: str | None = None) -> None:
        procs = {"scheduler": self.cell.proc.pid}
        if pids := self.cell.worker_pids():
            procs["worker"] = pids[0]
        for name, pid in procs.items():
            if only in (None, name):
                rss = _rss(pid)
                if rss:
                    self.report.rss.setdefault(name, []).append((label, rss))

    def _end_state(self) -> dict[str, float]:
        deadline = time.monotonic() + 30
        while True:  # the last releases travel with the step after the last response
            stats = self.cell.stats()
            idle = stats.shm_unacked_refs == 0 and stats.kv_blocks_free == stats.kv_blocks_total
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        end = {f.name: float(getattr(stats, f.name)) for f in stats.DESCRIPTOR.fields
               if f.type != f.TYPE_STRING and f.type != f.TYPE_MESSAGE}  # the figures
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        for m in re.finditer(r"^(tandem_\w+?)(?:\{reason=\"(\w+)\"\})? (\S+)$", text, re.M):
            name = m[1] + (f"_{m[2]}" if m[2] else "")
            end.setdefault(name.removeprefix("tandem_"), float(m[3]))
        return end


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def cell_flags(metrics_port: int, config: SoakConfig) -> tuple[str, ...]:
    return ("--kv-cache-size", "2Mi", "--mm-cache-size", "4Mi", "--metrics-port",
            str(metrics_port), "--step-timeout", str(config.step_timeout),
            "--log-level", "WARNING")


def print_report(report: SoakReport, config: SoakConfig) -> list[str]:
    e = report.end
    attempts = sum(report.statuses.values())
    print(f"requests {config.requests}, {config.concurrency} concurrent, {attempts} attempts "
          f"({report.retries} retried) in {report.elapsed:.1f} s: "
          f"{config.requests / report.elapsed:.1f} req/s, {report.tokens / report.elapsed:.0f} "
          f"tokens/s")
    print("statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(report.statuses.items()))
          + f"; {report.same_id_retries} cancelled streams retried with the same id")
    if report.stop_window:
        a, b = report.stop_window
        print(f"worker stopped (SIGSTOP) at {config.stop_at:.0%} of the requests for "
              f"{config.stop_for:.1f} s (step timeout {config.step_timeout:.1f} s); ready again "
              f"after {b - a:.1f} s")
    if report.restart_window:
        a, b = report.restart_window
        print(f"worker killed at {config.restart_at:.0%} of the requests; ready again after "
              f"{b - a:.1f} s")
    print(f"worker losses {e.get('worker_losses_total', 0):.0f}; in-doubt references released "
          f"{e.get('shm_released_in_doubt_total', 0):.0f}")
    print(f"images: {e.get('mm_cache_hits_total', 0):.0f} cache hits, "
          f"{e.get('mm_cache_misses_total', 0):.0f} misses, refused inline "
          f"{e.get('mm_cache_refused_total_full', 0):.0f} full / "
          f"{e.get('mm_cache_refused_total_oversize', 0):.0f} oversize; encoder runs "
          f"{e.get('encoder_runs_total', 0):.0f}")
    print(f"prefix cache: {e.get('prefix_cache_hit_tokens_total', 0):.0f} of "
          f"{e.get('prompt_tokens_total', 0):.0f} prompt tokens; preemptions "
          f"{e.get('preemptions_total', 0):.0f}")
    print(f"end state: shm_unacked_refs {e.get('shm_unacked_refs', -1):.0f}, ledger refs "
          f"{e.get('shm_ledger_refs', -1):.0f} ({e.get('shm_in_doubt_refs', -1):.0f} in doubt), "
          f"KV blocks free {e.get('kv_blocks_free', -1):.0f} of "
          f"{e.get('kv_blocks_total', -1):.0f}, segment {e.get('shm_objects', 0):.0f} objects / "
          f"{e.get('shm_used_bytes', 0) / MiB:.1f} MiB")
    print(f"ledger check after every step: {e.get('invariant_checks_total', 0):.0f} passed, "
          f"engine errors {e.get('engine_errors_total', 0):.0f}")
    for name, readings in report.rss.items():
        print(f"RSS {name}: " + ", ".join(f"{label} {rss / MiB:.0f} MiB"
                                          for label, rss in readings))
    failures = report.failures(config)
    print("PASS" if not failures else "FAIL: " + "; ".join(failures))
    return failures
