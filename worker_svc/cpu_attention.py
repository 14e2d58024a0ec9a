"""Decode attention that reads the paged KV cache in place, on the CPU (float32).

Without it, a decode step copies every sequence's whole context out of the cache in each
layer (``PagedKVCache.gather_blocks``) and hands the copy, padded to the longest context,
to ``F.scaled_dot_product_attention``, whose CPU kernel is built for long queries and
spends most of its time on the few query heads a decode has. ``cpu_attention.c`` walks
each sequence's blocks in place with a running softmax: measured on SmolLM2-135M's
geometry (batch 16, ~300-token contexts, 30 layers, 2 AVX2 cores), 0.6-0.75x the time of
gather + SDPA (docs/worker.md, "Where a decode step's time goes").

It is compiled when a model's caches are set up, once per process and cache geometry
(``cpu_build.py``), with the geometry as constants: the loops then have fixed trip counts
the compiler vectorizes. Where it cannot be built, ``decode_kernel`` returns None and
attention falls back to gather + SDPA, with one warning in the log.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from worker_svc.cpu_build import build_library

SOURCE = Path(__file__).with_name("cpu_attention.c")
# -ffast-math lets the compiler reassociate the dot products into vector lanes and use
# glibc's vector expf; the source keeps to finite numbers for it (-FLT_MAX, not -inf).
FAST_MATH = "-ffast-math"
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


@cache
def decode_kernel(n_kv_heads: int, n_rep: int, head_dim: int,
                  block_size: int) -> PagedDecodeKernel | None:
    """The kernel for this geometry, compiled on first use; None (and a warning, once per
    geometry) where it cannot be built here."""
    constants = [f"-DHKV={n_kv_heads}", f"-DREP={n_rep}", f"-DD={head_dim}",
                 f"-DBS={block_size}"]
    library = build_library(SOURCE, [FAST_MATH, *constants],
                            "decode attention gathers each context (gather + SDPA)")
    if library is None:
        return None
    return PagedDecodeKernel(library, n_kv_heads, n_rep, head_dim, block_size)
