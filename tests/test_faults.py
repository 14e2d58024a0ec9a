"""Faults of a local cell (``tandem serve``, real processes): client deadlines, a worker
killed with SIGKILL in the middle of streams, a worker killed while the cell is idle, and
SIGTERM (how Kubernetes stops a pod) while a stream runs.

What must hold: every client gets tokens or a clear status within a bounded time, health
follows the worker, the supervisor restarts it, serving resumes with the same greedy
outputs as before the fault, and nothing stays pinned or allocated.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.v1 import generate_pb2
from tandem_testing.cells import SERVICE, Cell, free_port, png, request, running_cell

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROMPT = "A shared prefix long enough to fill a few KV blocks, then an image: <image> what?"
FAIL_WITHIN_S = 10.0  # in-flight clients must get their status this soon after a kill
BACK_WITHIN_S = 90.0  # restart backoff + model load + warm-up on a loaded 2-core machine


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cell]:
    with running_cell(tmp_path_factory.mktemp("faults"), "--log-level", "INFO") as c:
        yield c


@pytest.fixture(scope="module")
def reference(cell: Cell) -> list[int]:
    """Greedy output of PROMPT before any fault (its prefix and image are cached after)."""
    return cell.generate(PROMPT, [png(1)], max_tokens=8)[0]


def _assert_clean(cell: Cell) -> None:
    """Nothing pinned, unacknowledged or allocated once the cell is idle."""
    stats = cell.stats()
    assert stats.shm_unacked_refs == 0, stats
    assert stats.kv_blocks_free == stats.kv_blocks_total, stats


def _wait_health(cell: Cell, status: int, timeout: float) -> float:
    """Seconds until the readiness health reads ``status``; fails after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if cell.health() == status:
                return time.monotonic() - start
        except grpc.RpcError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"health not {status} after {timeout}s")


def _kill_worker(cell: Cell) -> int:
    (pid,) = cell.worker_pids()
    os.kill(pid, signal.SIGKILL)
    return pid


def _new_worker(cell: Cell, old: int) -> int:
    pids = cell.worker_pids()
    assert len(pids) == 1 and pids != [old], pids
    return pids[0]


def test_deadline_ends_the_stream_and_releases_everything(cell: Cell, reference) -> None:
    msg = request("Deadline: <image> go on and on", [png(2)], max_tokens=1000,
                  ignore_eos=True)
    start = time.monotonic()
    received = 0
    with pytest.raises(grpc.RpcError) as err:
        for out in cell.stub.Generate(msg, timeout=1.0):
            received += len(out.token_ids)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 5.0
    assert 0 < received < 1000
    time.sleep(0.5)  # the server notices the deadline on its own clock
    _assert_clean(cell)
    # A deadline that passes while the request still waits for images to be processed.
    with pytest.raises(grpc.RpcError) as err:
        list(cell.stub.Generate(request("<image>", [png(3, 448, 448)]), timeout=0.001))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert cell.generate(PROMPT, [png(1)], max_tokens=8)[0] == reference
    _assert_clean(cell)


def test_worker_killed_mid_stream(cell: Cell, reference) -> None:
    started = [threading.Event() for _ in range(3)]
    outcome: dict[int, tuple[str, float]] = {}

    def client(n: int) -> None:
        msg = request(f"Client {n} streams <image> for a long time", [png(10 + n)],
                      max_tokens=1000, ignore_eos=True)
        try:
            for _ in cell.stub.Generate(msg, timeout=120):
                started[n].set()
            outcome[n] = ("OK", time.monotonic())
        except grpc.RpcError as exc:
            outcome[n] = (exc.code().name, time.monotonic())
        started[n].set()

    threads = [threading.Thread(target=client, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for event in started:
        assert event.wait(60)
    killed_at = time.monotonic()
    old = _kill_worker(cell)
    for t in threads:
        t.join(FAIL_WITHIN_S + 30)
    assert {code for code, _ in outcome.values()} == {"UNAVAILABLE"}, outcome
    assert max(at for _, at in outcome.values()) - killed_at < FAIL_WITHIN_S
    # Not ready until the restarted worker answers; new calls are refused meanwhile.
    _wait_health(cell, NOT_SERVING, 1.0)
    back = _wait_health(cell, SERVING, BACK_WITHIN_S)
    new = _new_worker(cell, old)
    assert new != old and back > 0
    # Serving resumes with the cached image (a fresh reference on the reset slot) and the
    # same greedy output; the dead worker's references were all accounted for.
    assert cell.generate(PROMPT, [png(1)], max_tokens=8)[0] == reference
    for n in range(3):
        cell.generate(f"Client {n} streams <image> for a long time", [png(10 + n)],
                      max_tokens=2)
    _assert_clean(cell)


def test_worker_killed_while_idle_is_noticed(cell: Cell, reference) -> None:
    """No step is in flight when the worker dies: the scheduler must still notice (health
    watch), or it would trust prefix-cache blocks the new worker never computed."""
    old = _kill_worker(cell)
    _wait_health(cell, NOT_SERVING, 5.0)
    _wait_health(cell, SERVING, BACK_WITHIN_S)
    _new_worker(cell, old)
    text_only = "A text-only prompt that fills several blocks of the prefix cache, twice."
    cold = cell.generate(text_only, max_tokens=8)
    warm = cell.generate(text_only, max_tokens=8)
    assert warm[2].usage.cached_prompt_tokens > 0 and warm[0] == cold[0]
    assert cell.generate(PROMPT, [png(1)], max_tokens=8)[0] == reference
    _assert_clean(cell)
    log = (Path(cell.shm_dir).parent / "cell.log").read_text()
    assert "restarting" in log, log[-2000:]


def test_sigterm_lets_a_running_stream_finish_within_the_grace(tmp_path: Path) -> None:
    """Fault 5 of issue 13: SIGTERM stops admitting at once (readiness NOT_SERVING on the
    probe port, new calls UNAVAILABLE) but the running stream finishes within the grace."""
    probes = free_port()
    with running_cell(tmp_path, "--health-listen", f"127.0.0.1:{probes}") as cell, \
            grpc.insecure_channel(f"127.0.0.1:{probes}") as channel:
        readiness = health_pb2_grpc.HealthStub(channel)

        def ready() -> int:
            return readiness.Check(health_pb2.HealthCheckRequest(service=SERVICE),
                                   timeout=5).status

        assert ready() == SERVING
        stream = cell.stub.Generate(request("Keep going <image>", [png(40)], max_tokens=120,
                                            ignore_eos=True), timeout=60)
        tokens = len(next(stream).token_ids)
        cell.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        while ready() != NOT_SERVING:
            assert time.monotonic() < deadline, "readiness still SERVING after SIGTERM"
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as err:
            cell.generate("Too late", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        last = None
        for last in stream:
            tokens += len(last.token_ids)
        assert tokens == 120 and last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert cell.proc.wait(30) == 0


def test_steps_a_stopped_worker_never_read_settle_while_the_cell_is_idle(
        tmp_path: Path) -> None:
    """Two replica workers (a reader slot each); worker 0 is stopped (SIGSTOP) before a
    request with images. Its step times out, the scheduler counts it lost and ends the
    step streams while the steps still sit unread in the stopped worker's socket, so that
    worker never sees them; worker 1 ran them and acknowledged. After SIGCONT the cell
    serves again and, with no further traffic, the references must settle: worker 0
    acknowledges on its own slot the steps it never received (worker.proto, Acknowledge).
    Before, they stayed unacknowledged for as long as the cell stayed idle, and the
    operator's ReferencesLeaking fired on a healthy cell (issue 22, item 5)."""
    with running_cell(tmp_path, "--workers", "2", "--step-timeout", "1.5",
                      "--log-level", "INFO") as cell:
        msg = request("Look at <image> and <image> then tell", [png(21), png(22)],
                      max_tokens=8)
        stopped = cell.worker_pids()[0]
        os.kill(stopped, signal.SIGSTOP)
        try:
            with pytest.raises(grpc.RpcError) as err:
                cell.stream(msg)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert cell.stats().shm_unacked_refs > 0  # the stopped slot's, in doubt
        finally:
            os.kill(stopped, signal.SIGCONT)
        _wait_health(cell, SERVING, 30.0)
        deadline = time.monotonic() + 10.0
        while (unacked := cell.stats().shm_unacked_refs) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert unacked == 0, "an idle cell still reports unacknowledged references"
        assert cell.worker_pids()[0] == stopped  # the same, live worker: no slot reset
        assert len(cell.stream(msg)[0]) == 8
        _assert_clean(cell)
