"""The environment a benchmark ran in, printed with its figures (docs/benchmarks.md):
absolute numbers on these shared machines mean nothing without the CPU, the thread
count, the versions, the allocator settings and how busy the machine was.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import google.protobuf
import grpc
import torch


def environment_lines() -> list[str]:
    """Two lines: software (versions, torch threads, malloc settings), then hardware (CPU
    model, cores, L3, transparent huge pages, the load average now)."""
    malloc = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                      if k.startswith("MALLOC_")) or "default"
    software = (f"python {platform.python_version()}  torch {torch.__version__} "
                f"({torch.get_num_threads()} threads)  grpcio {grpc.__version__}  "
                f"protobuf {google.protobuf.__version__}  malloc {malloc}")
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    l3 = _read("/sys/devices/system/cpu/cpu0/cache/index3/size")
    hardware = (f"cpu {_cpu_model()} x{os.cpu_count()}  L3 {l3}  THP {_thp()}  "
                f"load average {load} (1/5/15 min)")
    return [software, hardware]


def memcpy_gbps(nbytes: int, device: torch.device) -> float:
    """Bytes copied per second between two pre-faulted buffers of ``nbytes`` (median of 5):
    a decode step reads every weight once, so weights / this is its roofline."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9  # the first copy faults ``dst`` in


def _cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _thp() -> str:
    """The selected transparent-huge-page mode (the bracketed word)."""
    text = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text or "unknown"


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "unknown"
