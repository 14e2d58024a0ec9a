"""The CPUs a process may use (tandem/cpus.py), read from cgroup files as a container sees
them, and the worker's torch threads set from them (issue 23: a thread budget that fits
the cores a process really has)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tandem.cpus import cgroup_cpu_quota, usable_cpus
from tandem_cli.cli import _worker_config, build_parser
from worker_svc.config import WorkerConfig
from worker_svc.server import set_thread_budget

AFFINITY = len(os.sched_getaffinity(0))


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


@pytest.mark.parametrize(("files", "quota"), [
    ({"cpu.max": "150000 100000"}, 1.5),  # cgroup v2, a 1.5-CPU limit
    ({"cpu.max": "max 100000"}, None),  # v2 without a limit
    ({"cpu/cpu.cfs_quota_us": "50000", "cpu/cpu.cfs_period_us": "100000"}, 0.5),  # v1
    ({"cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"}, None),
    ({"cpu.max": "garbage"}, None),
    ({}, None),  # no cgroup files at all
])
def test_the_cgroup_quota_is_read_as_a_container_sees_it(tmp_path: Path, files: dict[str, str],
                                                         quota: float | None) -> None:
    assert cgroup_cpu_quota(_write(tmp_path, files)) == quota


def test_usable_cpus_are_the_affinity_capped_by_the_quota_rounded_up(tmp_path: Path) -> None:
    assert usable_cpus(_write(tmp_path / "none", {})) == AFFINITY
    assert usable_cpus(_write(tmp_path / "half", {"cpu.max": "50000 100000"})) == 1
    assert usable_cpus(_write(tmp_path / "big", {"cpu.max": "6400000 100000"})) == AFFINITY


def test_the_worker_takes_its_thread_budget() -> None:
    before = torch.get_num_threads()
    try:
        assert set_thread_budget(WorkerConfig(shm_dir="x", threads=1)) == 1
        assert torch.get_num_threads() == 1
        assert set_thread_budget(WorkerConfig(shm_dir="x")) == usable_cpus()
        assert torch.get_num_threads() == usable_cpus()
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads must be >= 0"):
        WorkerConfig(shm_dir="x", threads=-1)


@pytest.mark.parametrize(("argv", "env", "threads", "adapt"), [
    (["worker"], {}, 0, True),  # the automatic budget adapts by default
    (["worker", "--torch-threads", "2"], {}, 2, False),  # an explicit count stays fixed
    (["worker", "--no-adapt-torch-threads"], {}, 0, False),
    (["worker"], {"TANDEM_ADAPT_TORCH_THREADS": "0"}, 0, False),
    (["serve"], {}, 2, True),  # serve's share of the CPUs is a budget too
])
def test_only_an_automatic_thread_budget_adapts(monkeypatch: pytest.MonkeyPatch,
                                                argv: list[str], env: dict[str, str],
                                                threads: int, adapt: bool) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(argv)
    config = _worker_config(args, 0, 1, 0, threads=2 if argv == ["serve"] else None)
    assert (config.threads, config.adapt_threads) == (threads, adapt)
