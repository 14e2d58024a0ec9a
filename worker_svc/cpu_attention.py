"""Attention that reads the paged KV cache in place, on the CPU (float32): decodes and
prefill chunks.

Without it, a decode step copies every sequence's whole context out of the cache in each
layer (``PagedKVCache.gather_blocks``) and hands the copy, padded to the longest context,
to ``F.scaled_dot_product_attention``, whose CPU kernel is built for long queries and
spends most of its time on the few query heads a decode has. ``cpu_attention.c`` walks
each sequence's blocks in place with a running softmax: measured on SmolLM2-135M's
geometry (batch 16, ~300-token contexts, 30 layers, 2 AVX2 cores), 0.6-0.75x the time of
gather + SDPA (docs/worker.md, "Where a decode step's time goes").

Keys are cached by dimension (``PagedKVCache(keys_by_dim=True)``), so a query's scores
against a block are vector lanes rather than one horizontal sum per key. A prefill chunk
(n queries of one sequence, query i seeing the slots up to its position) has a function of
its own, ``paged_prefill``: tiles of query rows share each block's reads. Decodes and
chunks run the same per-row code, so a position gets the same bits either way. Measured on
SmolLM2-135M's geometry, 2 AVX-512 cores: a 480-token prefill's attention (30 layers) took
65 ms, against 117 as 480 decodes over the former layout (docs/worker.md).

It is compiled when a model's caches are set up, once per process and cache geometry
(``cpu_build.py``), with the geometry as constants: the loops then have fixed trip counts
the compiler vectorizes. Where it cannot be built, ``attention_kernel`` returns None and
attention falls back to gather + SDPA, with one warning in the log.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from worker_svc.cpu_build import FAST_MATH, address, build_library

SOURCE = Path(__file__).with_name("cpu_attention.c")


class PagedAttentionKernel:
    """The compiled kernels for one cache geometry."""

    def __init__(self, library: ctypes.CDLL, n_kv_heads: int, n_rep: int, head_dim: int,
                 block_size: int) -> None:
        self.n_kv_heads, self.n_rep, self.head_dim, self.block_size = (
            n_kv_heads, n_rep, head_dim, block_size)
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        self._decode = library.paged_decode
        self._decode.restype = None
        self._decode.argtypes = [ptr] * 4 + [ctypes.c_int64] + [ptr] * 2 + [
            i32, ctypes.c_float, i32]
        self._prefill = library.paged_prefill
        self._prefill.restype = None
        self._prefill.argtypes = [ptr] * 6 + [i32, ctypes.c_float, i32]
        self.part = address(library, "paged_attention_part")  # a step's, for cpu_decoder.c

    def decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
               lengths: Tensor) -> Tensor:
        """As ``Attention._attend_decode`` computes: q (B, H, D), query b against the first
        ``lengths[b]`` slots of the blocks in ``block_table[b]``."""
        q = self._checked(q, k_cache, v_cache, block_table, lengths)
        out = torch.empty_like(q)
        self._decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                     block_table.data_ptr(), block_table.stride(0), lengths.data_ptr(),
                     out.data_ptr(), q.shape[0], self.head_dim ** -0.5,
                     torch.get_num_threads())
        return out

    def prefill(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, blocks: Tensor,
                lengths: Tensor) -> Tensor:
        """One sequence's chunk: q (Q, H, D), query i against the first ``lengths[i]``
        slots of ``blocks`` (N,)."""
        q = self._checked(q, k_cache, v_cache, blocks.expand(q.shape[0], -1), lengths)
        out = torch.empty_like(q)
        self._prefill(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), blocks.data_ptr(),
                      lengths.data_ptr(), out.data_ptr(), q.shape[0], self.head_dim ** -0.5,
                      torch.get_num_threads())
        return out

    def _checked(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                 lengths: Tensor) -> Tensor:
        """q made contiguous, once every layout the C code reads is checked: it trusts
        its pointers, and a wrong layout would read out of bounds. Lengths past the
        table's blocks are the runner's to refuse (it checks every position)."""
        b = q.shape[0]
        geometry = (self.block_size, self.n_kv_heads, self.head_dim)
        if (q.shape[1:] != (self.n_kv_heads * self.n_rep, self.head_dim)
                or v_cache.shape[1:] != geometry
                or k_cache.shape != (v_cache.shape[0], self.n_kv_heads, self.head_dim,
                                     self.block_size)
                or block_table.shape[0] != b or lengths.shape != (b,)
                or block_table.dtype != torch.int64 or lengths.dtype != torch.int64
                or q.dtype != torch.float32 or k_cache.dtype != torch.float32
                or not (k_cache.is_contiguous() and v_cache.is_contiguous()
                        and block_table.stride(1) == 1 and lengths.is_contiguous())):
            raise ValueError(f"paged attention kernel for {geometry} called with q "
                             f"{tuple(q.shape)} {q.dtype}, cache {tuple(k_cache.shape)} "
                             f"{k_cache.dtype}, table {tuple(block_table.shape)}")
        return q.contiguous()


@cache
def attention_kernel(n_kv_heads: int, n_rep: int, head_dim: int,
                     block_size: int) -> PagedAttentionKernel | None:
    """The kernel for this geometry, compiled on first use; None (and a warning, once per
    geometry) where it cannot be built here."""
    constants = [f"-DHKV={n_kv_heads}", f"-DREP={n_rep}", f"-DD={head_dim}",
                 f"-DBS={block_size}"]
    library = build_library(SOURCE, [FAST_MATH, *constants],
                            "attention gathers each context (gather + SDPA)")
    if library is None:
        return None
    return PagedAttentionKernel(library, n_kv_heads, n_rep, head_dim, block_size)
