"""Settings of one worker process (flags and TANDEM_* variables: docs/configuration.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandem.shutdown import DEFAULT_GRACE_S

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    shm_dir: str  # shared with the scheduler: segment file and worker-<rank>.sock
    model: str = "tiny"  # preset name, or a directory: Hugging Face layout or export-model's
    rank: int = 0  # SHM reader slot
    world_size: int = 1
    worker_listen: str = ""  # extra TCP host:port ("" = Unix socket only)
    health_listen: str = ""  # plaintext host:port with grpc.health.v1 only (probes)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | bfloat16 | float16 | float32
    block_size: int = 16  # tokens per KV block; must equal the scheduler's
    kv_cache_bytes: int = 256 * MiB  # KV budget on CPU
    gpu_memory_fraction: float = 0.8  # KV budget on CUDA: fraction of free memory
    metrics_port: int = 0  # Prometheus /metrics (0 = off; served by the observability layer)
    tensor_parallel_size: int = 1  # ranks sharing one copy of the model (divides world_size)
    tp_master_addr: str = "127.0.0.1"  # host of worker 0, where the TP ranks meet
    tp_master_port: int = 29500
    threads: int = 0  # torch intra-op threads; 0: every CPU the process may use (tandem.cpus)
    # fewer while they wait for CPUs other jobs hold, back up to ``threads`` when those are
    # idle again (worker_svc/thread_team.py); the CLI keeps an explicit --torch-threads fixed
    adapt_threads: bool = True
    # SIGTERM: steps of a scheduler still streaming run this long (tandem.shutdown)
    shutdown_grace_s: float = DEFAULT_GRACE_S

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside 0..{self.world_size - 1}")
        if self.block_size <= 0 or self.kv_cache_bytes <= 0:
            raise ValueError("block_size and kv_cache_bytes must be positive")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype {self.dtype!r} is not auto, bfloat16, float16 or float32")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: every usable CPU), not {self.threads}")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError("gpu_memory_fraction must be in (0, 1]")
        if self.tensor_parallel_size < 1 or self.world_size % self.tensor_parallel_size:
            raise ValueError(f"{self.world_size} workers are not a multiple of "
                             f"tensor_parallel_size {self.tensor_parallel_size}")

    @property
    def socket_path(self) -> Path:
        return Path(self.shm_dir).absolute() / f"worker-{self.rank}.sock"
