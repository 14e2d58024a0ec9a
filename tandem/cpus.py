"""How many CPUs this process may really use: its affinity, capped by its cgroup's quota.

``os.cpu_count()`` (and torch's default thread count) sees every core of the node, but a
container limited to 4 CPUs on a 64-core node gets 4 CPUs' worth of time: 64 OpenMP threads
there are throttled together, and each barrier of the team waits for its slowest, descheduled
thread. The quota is read where a container sees its own cgroup (cgroup v2 ``cpu.max``,
v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); none, or an unlimited one, caps nothing.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs' worth of time the cgroup allows (1.5 for ``150000 100000``); None if unlimited
    or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for v1 in (root / "cpu", root / "cpu,cpuacct"):
        try:
            quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
            period_us = int((v1 / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    return None


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """The CPUs this process may run on, at most its cgroup's quota rounded up (>= 1)."""
    cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(root)
    return max(1, min(cpus, math.ceil(quota)) if quota is not None else cpus)
