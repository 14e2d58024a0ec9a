"""The decoder's elementwise ops on the CPU in float32, each one compiled pass
(``cpu_ops.c``): RMSNorm (with the residual add before it), SwiGLU's ``silu(gate) * up``,
and rotating q and k with the new keys and values written into the paged cache.

torch runs each as a chain of small ops, each a walk over the activations and a dispatch:
measured on SmolLM2-135M (2 AVX-512 cores), ~58 ms of a 480-token prefill forward and ~11
of a batch-16 decode step went to them beside the GEMMs and attention (docs/worker.md,
"Where a decode step's time goes"). The model takes these where :func:`cpu_ops` builds
(``cpu_build.py``), the torch ops elsewhere (other devices and dtypes, no compiler).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from worker_svc.cpu_build import FAST_MATH, address, build_library

SOURCE = Path(__file__).with_name("cpu_ops.c")


def _float_rows(*tensors: Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
               for t in tensors)


class CpuOps:
    """The compiled ``cpu_ops.c``. The C code trusts its pointers, so each call checks the
    shapes, dtypes and layouts it is given and raises ``ValueError`` on a mismatch."""

    def __init__(self, library: ctypes.CDLL) -> None:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._norm = library.rms_norm
        self._norm.restype = None
        self._norm.argtypes = [ptr] * 4 + [i64, i32, ctypes.c_float, i32]
        self._silu_mul = library.silu_mul
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [ptr, ptr, i64, i32, i32]
        self._rotate = library.rotate_into_cache
        self._rotate.restype = i64
        self._rotate.argtypes = [ptr] * 6 + [i64, i32, i32, i32, i32, i64, i32]
        # each op's share of a team's work, for cpu_decoder.c
        self.parts = {op: address(library, f"{name}_part") for op, name in (
            ("norm", "rms_norm"), ("silu", "silu_mul"), ("rotate", "rotate_into_cache"))}

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float,
                 residual: Tensor | None = None) -> Tensor:
        """RMSNorm of x (..., dim) scaled by ``weight``; with ``residual``, x += residual
        first, in place (x must be the caller's own fresh tensor)."""
        dim = x.shape[-1]
        if (not _float_rows(x, weight) or weight.shape != (dim,)
                or (residual is not None and (residual.shape != x.shape
                                              or not _float_rows(residual)))):
            raise ValueError(f"rms_norm called with x {tuple(x.shape)} {x.dtype}, weight "
                             f"{tuple(weight.shape)} {weight.dtype}")
        out = torch.empty_like(x)
        self._norm(x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                   weight.data_ptr(), out.data_ptr(), x.numel() // max(dim, 1), dim, eps,
                   torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """(..., 2 I) gate columns then up columns -> (..., I) silu(gate) * up."""
        inter = gate_up.shape[-1] // 2
        if not _float_rows(gate_up) or gate_up.shape[-1] != 2 * inter:
            raise ValueError(f"silu_mul called with {tuple(gate_up.shape)} {gate_up.dtype}")
        out = gate_up.new_empty(*gate_up.shape[:-1], inter)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), out.numel() // max(inter, 1), inter,
                       torch.get_num_threads())
        return out

    def rotate_into_cache(self, qkv: Tensor, rot: Tensor, slots: Tensor, k_cache: Tensor,
                          v_cache: Tensor, n_heads: int) -> Tensor:
        """qkv (T, (H + 2 Hkv) D), rot (T, D/2) complex -> q (T, H, D) rotated; k rotated
        and v written at ``slots`` (T,) of the caches: keys (blocks, Hkv, D, block_size),
        values (blocks, block_size, Hkv, D) (``PagedKVCache`` with ``keys_by_dim``)."""
        t = qkv.shape[0]
        blocks, bs, hkv, dim = v_cache.shape
        cs = torch.view_as_real(rot)
        if (not _float_rows(qkv, cs, k_cache, v_cache)
                or k_cache.shape != (blocks, hkv, dim, bs)
                or qkv.shape != (t, (n_heads + 2 * hkv) * dim) or cs.shape != (t, dim // 2, 2)
                or slots.shape != (t,) or slots.dtype != torch.int64
                or not slots.is_contiguous()):
            raise ValueError(f"rotate_into_cache called with qkv {tuple(qkv.shape)}, rot "
                             f"{tuple(rot.shape)}, slots {tuple(slots.shape)} {slots.dtype}, "
                             f"caches {tuple(k_cache.shape)} {tuple(v_cache.shape)} "
                             f"{k_cache.dtype}")
        q = qkv.new_empty(t, n_heads, dim)
        bad = self._rotate(qkv.data_ptr(), cs.data_ptr(), slots.data_ptr(), q.data_ptr(),
                           k_cache.data_ptr(), v_cache.data_ptr(), t, n_heads, hkv, dim, bs,
                           blocks * bs, torch.get_num_threads())
        if bad:
            raise IndexError(f"{bad} of {t} cache slots out of range (0..{blocks * bs - 1})")
        return q


@cache
def cpu_ops() -> CpuOps | None:
    """The ops, built once per process; None (and a warning) where they cannot be."""
    # fast math for SiLU's vector expf; the source caps its exponent to stay finite
    library = build_library(SOURCE, [FAST_MATH], "elementwise ops stay torch's")
    return None if library is None else CpuOps(library)
