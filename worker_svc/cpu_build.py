"""Build a C kernel of the worker for this machine, at load, and load it (``ctypes``).

The worker's CPU kernels (``cpu_attention.c``, ``cpu_gemm.c``, ``cpu_ops.c``, and
``cpu_decoder.c``, which runs the others over every layer of a step in one call) ship as C
source in the wheel and are compiled when a model is loaded, by the C compiler on the
machine (``$CC``, else ``cc``) with ``-march=native``: the code then uses the vector
width this CPU has (AVX-512, AVX2, NEON), and a kernel may take its geometry as
constants. Each is linked against the OpenMP runtime torch itself loaded, so a kernel's
threads are torch's team (``torch.get_num_threads()`` per call), never a second pool
competing for the same cores.

Where there is no compiler, torch brings no ``libgomp`` (a macOS build) or the compiled
library cannot be loaded (a temporary directory mounted ``noexec``), :func:`build_library`
returns None and logs why; the caller then keeps torch's path for that work.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Compile only: a link with -ffast-math (which a kernel may ask for) adds crtfastmath.o
# (GCC before 13), whose constructor turns on flush-to-zero for the whole process as the
# library loads, and every subnormal float in torch and Python then reads as zero.
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-c")
# What lets GCC call glibc's vector expf (libmvec) in a vectorized loop; a kernel that asks
# for it keeps its numbers finite (it may assume no infinities or NaNs).
FAST_MATH = "-ffast-math"
# GCC vectorizes loops 256 bits wide even where the CPU has AVX-512 (older Xeons slowed
# their clock for 512-bit work). Measured on a Sapphire Rapids Xeon, 512 bits took 0.88x
# the time of decode attention and 0.85x of a prefill chunk's (docs/worker.md).
WIDE_VECTORS = "-mprefer-vector-width=512"


def torch_openmp() -> Path | None:
    """The OpenMP runtime torch loaded (``torch/lib/libgomp.so.1`` in Linux wheels)."""
    path = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    return path if path.exists() else None


def avx512() -> bool:
    """Whether this CPU has AVX-512 (torch's own reading of it, the one the GEMM choice and
    the vector width above follow)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def build_library(source: Path, flags: Sequence[str], fallback: str) -> ctypes.CDLL | None:
    """``source`` compiled with ``flags`` (constants, optimisation options) and loaded;
    None where it cannot be built here, with a warning that begins with ``fallback`` (what
    the worker does instead) and says why."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    openmp = torch_openmp()
    if compiler is None or openmp is None:
        log.warning("%s: %s", fallback, "no C compiler ($CC or cc) on PATH" if compiler is None
                    else "torch brings no libgomp to link the CPU kernel against")
        return None
    wide = [WIDE_VECTORS] if avx512() else []
    # The library is loaded and its file removed at once: dlopen keeps the mapping, and
    # no file compiled for this CPU (-march=native) outlives the process to be reused on
    # another machine.
    with tempfile.TemporaryDirectory(prefix="tandem-kernel-") as tmp:
        obj, target = Path(tmp) / f"{source.stem}.o", Path(tmp) / f"{source.stem}.so"
        for command in (
            [compiler, *COMPILE_FLAGS, *wide, *flags, str(source), "-o", str(obj)],
            [compiler, "-shared", str(obj), "-o", str(target), f"-L{openmp.parent}",
             "-l:libgomp.so.1", f"-Wl,-rpath,{openmp.parent}", "-lm"],
        ):
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                log.warning("%s: %s failed: %s", fallback, " ".join(command),
                            result.stderr.strip()[-2000:])
                return None
        try:
            return ctypes.CDLL(str(target))
        except OSError as e:  # e.g. a temporary directory mounted noexec
            log.warning("%s: the compiled kernel could not be loaded from %s: %s", fallback,
                        tmp, e)
            return None


def address(library: ctypes.CDLL, name: str) -> int:
    """The address of function ``name`` of ``library``: how one compiled kernel hands
    another's to C (``cpu_decoder.c`` calls the others' ``_part`` functions)."""
    pointer = ctypes.cast(getattr(library, name), ctypes.c_void_p).value
    if not pointer:
        raise OSError(f"{name} has no address in {library._name}")
    return pointer
