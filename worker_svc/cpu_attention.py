"""Decode attention that reads the paged KV cache in place, on the CPU (float32).

Without it, a decode step copies every sequence's whole context out of the cache in each
layer (``PagedKVCache.gather_blocks``) and hands the copy, padded to the longest context,
to ``F.scaled_dot_product_attention``, whose CPU kernel is built for long queries and
spends most of its time on the few query heads a decode has. ``cpu_attention.c`` walks
each sequence's blocks in place with a running softmax: measured on SmolLM2-135M's
geometry (batch 16, ~300-token contexts, 30 layers, 2 AVX2 cores), 0.6-0.75x the time of
gather + SDPA (docs/worker.md, "Where a decode step's time goes").

The C source is compiled when a model's caches are set up, once per process and cache
geometry, by the C compiler on the machine (``$CC``, else ``cc``) with the geometry as
constants and ``-march=native``: the loops then have fixed trip counts the compiler
vectorizes. It is linked against the OpenMP runtime torch itself loaded, so the kernel's
threads are torch's team (``torch.get_num_threads()`` per call), never a second pool
competing for the same cores. Where there is no compiler or torch brings no ``libgomp``
(a slim container image, a macOS build), ``decode_kernel`` returns None and attention
falls back to gather + SDPA, with one warning in the log.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.c")
# -ffast-math lets the compiler reassociate the dot products into vector lanes and use
# glibc's vector expf; the source keeps to finite numbers for it (-FLT_MAX, not -inf).
# Compile only: a link with -ffast-math adds crtfastmath.o (GCC before 13), whose
# constructor turns on flush-to-zero for the whole process as the library loads, and every
# subnormal float in torch and Python then reads as zero.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c")
# Fewer sequences than this many per thread: tasks are (sequence, key head) pairs instead
# of sequences, so that one or two sequences still keep every thread busy.
SEQUENCES_PER_THREAD = 4


class PagedDecodeKernel:
    """The compiled kernel for one cache geometry; call it like ``Attention._attend_decode``
    computes: q (B, H, D) against each sequence's first ``lengths[b]`` slots."""

    def __init__(self, library: ctypes.CDLL, n_kv_heads: int, n_rep: int, head_dim: int,
                 block_size: int) -> None:
        self.n_kv_heads, self.n_rep, self.head_dim, self.block_size = (
            n_kv_heads, n_rep, head_dim, block_size)
        self._fn = library.paged_decode
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [
            ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                 lengths: Tensor) -> Tensor:
        b = q.shape[0]
        geometry = (self.block_size, self.n_kv_heads, self.head_dim)
        # The C code trusts its pointers: a wrong layout here would read out of bounds.
        if (q.shape[1:] != (self.n_kv_heads * self.n_rep, self.head_dim)
                or k_cache.shape[1:] != geometry or v_cache.shape != k_cache.shape
                or block_table.shape[0] != b or lengths.shape != (b,)
                or block_table.dtype != torch.int64 or lengths.dtype != torch.int64
                or q.dtype != torch.float32 or k_cache.dtype != torch.float32
                or not (k_cache.is_contiguous() and v_cache.is_contiguous()
                        and block_table.stride(1) == 1 and lengths.is_contiguous())):
            raise ValueError(f"paged decode kernel for {geometry} called with q "
                             f"{tuple(q.shape)} {q.dtype}, cache {tuple(k_cache.shape)} "
                             f"{k_cache.dtype}, table {tuple(block_table.shape)}")
        q = q.contiguous()
        out = torch.empty_like(q)
        threads = torch.get_num_threads()
        split = 1 if b >= SEQUENCES_PER_THREAD * threads else self.n_kv_heads
        self._fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
                 block_table.stride(0), lengths.data_ptr(), out.data_ptr(), b, split,
                 self.head_dim ** -0.5, threads)
        return out


def torch_openmp() -> Path | None:
    """The OpenMP runtime torch loaded (``torch/lib/libgomp.so.1`` in Linux wheels)."""
    path = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    return path if path.exists() else None


@cache
def decode_kernel(n_kv_heads: int, n_rep: int, head_dim: int,
                  block_size: int) -> PagedDecodeKernel | None:
    """The kernel for this geometry, compiled on first use; None (and a warning, once per
    geometry) where it cannot be built here."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    openmp = torch_openmp()
    if compiler is None or openmp is None:
        log.warning("decode attention gathers each context (gather + SDPA): %s",
                    "no C compiler ($CC or cc) on PATH" if compiler is None
                    else "torch brings no libgomp to link the CPU kernel against")
        return None
    constants = [f"-DHKV={n_kv_heads}", f"-DREP={n_rep}", f"-DD={head_dim}",
                 f"-DBS={block_size}"]
    # The library is loaded and its file removed at once: dlopen keeps the mapping, and
    # no file compiled for this CPU (-march=native) outlives the process to be reused on
    # another machine.
    with tempfile.TemporaryDirectory(prefix="tandem-kernel-") as tmp:
        obj, target = Path(tmp) / "paged_decode.o", Path(tmp) / "paged_decode.so"
        for command in (
            [compiler, *COMPILE_FLAGS, *constants, str(SOURCE), "-o", str(obj)],
            [compiler, "-shared", str(obj), "-o", str(target), f"-L{openmp.parent}",
             "-l:libgomp.so.1", f"-Wl,-rpath,{openmp.parent}", "-lm"],
        ):
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                log.warning("decode attention gathers each context (gather + SDPA): %s "
                            "failed: %s", " ".join(command), result.stderr.strip()[-2000:])
                return None
        library = ctypes.CDLL(str(target))
    return PagedDecodeKernel(library, n_kv_heads, n_rep, head_dim, block_size)
