"""Linear layers whose weights are laid out once for the CPU's GEMM, at load.

Two layouts, one chosen per worker by :func:`pack_linears`:

* **Column panels, multiplied by our own kernel** (``cpu_gemm.c``, :class:`PanelLinear`),
  on CPUs with AVX-512 where the kernel builds (``cpu_build.py``). Measured on
  SmolLM2-135M's 151 weights per step, streamed from DRAM, 2 AVX-512 cores (Xeon): 0.80x
  oneDNN's time at 1 row, 0.85-0.88x at 4-16 rows, 0.95-0.99x at 160-512 rows, before
  decode batches became one pass over the weights (a batch-16 decode step now ~0.75x
  oneDNN's; docs/worker.md, "Where a decode step's time goes"). The panels are a plain tensor the
  size of the weight: no per-size GEMM state, nothing to warm up. On AVX2 the same source
  runs, but oneDNN's kernels are faster there (1.1-1.6x less time, measured on the same
  Xeon with ``-march=haswell``), so AVX2 machines keep oneDNN.
* **oneDNN's blocked layout** (:class:`PackedLinear`), everywhere else on the CPU.

``F.linear`` on the CPU hands each call to MKL's sgemm, which re-lays the weight matrix out
for its kernel on every call. At serving sizes (a decode step multiplies 1-64 rows by each
weight) that per-call packing, over weights streamed from memory, is most of the GEMM's
time. oneDNN can take the weight in its kernel's blocked layout once
(``torch.ops.mkldnn._reorder_linear_weight``, the packing inductor's CPU freezing pass
uses) and multiply by it directly. Measured on SmolLM2-135M's decode GEMMs, weights
streamed from DRAM, 2 AVX2 cores: 0.41-0.75x the time of ``F.linear`` at 1 to 512 rows
(docs/worker.md, "Where a decode step's time goes").

oneDNN builds (and caches) a GEMM primitive for every row count it sees, and each holds
its own buffers: ~0.6 MB per (rows, weight) pair here, so the row counts of a serving step
(1 to the step budget) would grow a worker by gigabytes. Rows are therefore padded to a
few sizes (``padded_rows``): up to 16 the next power of two (decode: a GEMM over weights
streamed from memory costs nearly the same at 9 rows as at 16), above that the next
multiple of 16 (prefill, where the GEMMs are compute-bound and padded rows cost their
share: 150 rows padded to 192 took 1.2-1.3x the time of 160).

The packed weight is an opaque tensor: it has no strides, no storage Python can read, and
cannot be deep-copied or moved to another device. So packing is the last step of loading a
serving model (after the tensor-parallel shard is cut, before hooks attach), only on the
CPU in float32, and ``state_dict`` users (export, tests of the loaders) work on the model
before it.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker_svc.cpu_build import address, avx512, build_library

log = logging.getLogger(__name__)

# oneDNN picks its blocking for this many rows; the measured times at 1 and 512 rows
# hardly differ between hints of 16 and 64.
BATCH_HINT = 16
# Rows whose padded sizes get their GEMM primitives at load: the scheduler's default step
# budget (--max-num-batched-tokens). A larger step builds its size's the first time.
WARM_ROWS = 512


def padded_rows(rows: int) -> int:
    """The row count a GEMM of ``rows`` rows runs at (see the module docstring)."""
    if rows <= 16:
        return 1 << max(rows - 1, 0).bit_length()
    return -(-rows // 16) * 16


GEMM_SOURCE = Path(__file__).with_name("cpu_gemm.c")
PANEL = 16  # columns per panel: cpu_gemm.c's PW


class PanelGemm:
    """The compiled ``cpu_gemm.c``: ``y (M, N) = x (M, K) @ w^T`` over panels."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.panel_gemm
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
        multiple = library.gemm_columns_multiple
        multiple.restype = ctypes.c_int
        self.columns_multiple = int(multiple())  # what N is padded to
        self.part = address(library, "panel_gemm_part")  # for cpu_decoder.c

    def panels(self, weight: Tensor) -> Tensor:
        """(N, K) -> (N'/16, K, 16), N' the next multiple of ``columns_multiple``, the
        padding zeros."""
        n, k = weight.shape
        padded = -(-n // self.columns_multiple) * self.columns_multiple
        w = F.pad(weight.detach().float(), (0, 0, 0, padded - n))
        return w.view(padded // PANEL, PANEL, k).transpose(1, 2).contiguous()

    def __call__(self, x: Tensor, panels: Tensor) -> Tensor:
        """x (M, K) contiguous float32 -> (M, N') float32."""
        p, k, width = panels.shape
        # The C code trusts its pointers: a wrong layout here would read out of bounds.
        if (x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32
                or panels.dtype != torch.float32 or width != PANEL
                or (p * PANEL) % self.columns_multiple or not x.is_contiguous()
                or not panels.is_contiguous()):
            raise ValueError(f"panel GEMM called with x {tuple(x.shape)} {x.dtype} and "
                             f"panels {tuple(panels.shape)} {panels.dtype}")
        out = torch.empty(x.shape[0], p * PANEL)
        self._fn(x.data_ptr(), panels.data_ptr(), out.data_ptr(), x.shape[0], p * PANEL, k,
                 torch.get_num_threads())
        return out


@cache
def panel_gemm() -> PanelGemm | None:
    """The GEMM kernel, built once per process; None (and a warning) where it cannot be."""
    library = build_library(GEMM_SOURCE, [], "linear layers keep oneDNN's layout")
    return None if library is None else PanelGemm(library)


def panels_pay() -> bool:
    """Where the panel kernel beats oneDNN (measured): CPUs with AVX-512."""
    return avx512()


class PanelLinear(nn.Module):
    """``nn.Linear``'s forward over its weight in column panels (``cpu_gemm.c``)."""

    def __init__(self, linear: nn.Linear, gemm: PanelGemm) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.gemm = gemm
        self.register_buffer("weight", gemm.panels(linear.weight), persistent=False)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = self.gemm(rows, self.weight)[:, :self.out_features]  # the padding columns off
        if self.bias is not None:
            out.add_(self.bias)  # the GEMM's own output: no second tensor
        return out.reshape(*x.shape[:-1], self.out_features)


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a weight in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(
            linear.weight.detach(), BATCH_HINT), persistent=False)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        n = rows.shape[0]
        padded = padded_rows(n)
        if padded != n:
            rows = F.pad(rows, (0, 0, 0, padded - n))
        out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return out[:n].view(*x.shape[:-1], self.out_features)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Float32 on a CPU with oneDNN (every x86-64 and aarch64 torch build)."""
    return (device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available())


def pack_linears(model: nn.Module, warm_rows: int = WARM_ROWS,
                 panels: bool | None = None) -> int:
    """Replace every ``nn.Linear`` of ``model``, when its weights are float32 on the CPU, by
    a ``PanelLinear`` (``panels``; None: where they pay, :func:`panels_pay`, and the kernel
    builds) or else a ``PackedLinear``, building oneDNN's GEMM primitives of every padded
    size up to ``warm_rows`` now; returns how many layers were replaced (0 elsewhere:
    CUDA, bf16).

    NOTE: oneDNN's are built at load rather than when a size first comes: a primitive's
    buffers would otherwise grow the worker after its warm-up (the soak test's flat-RSS
    check), and the first request of each size would pay for building them. Layers of one
    shape share their primitives, so one layer per shape is run."""
    first = next(model.parameters())
    if first.device.type != "cpu" or first.dtype != torch.float32:
        return 0
    gemm = panel_gemm() if (panels_pay() if panels is None else panels) else None
    if gemm is None and not can_pack(first.device, first.dtype):
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    if gemm is not None:
        for parent, name, child in targets:
            setattr(parent, name, PanelLinear(child, gemm))
        log.info("linear layers in column panels (cpu_gemm.c)")
        return len(targets)
    shapes: dict[tuple[int, int, bool], PackedLinear] = {}
    for parent, name, child in targets:
        packed = PackedLinear(child)
        setattr(parent, name, packed)
        shapes.setdefault((packed.in_features, packed.out_features, packed.bias is not None),
                          packed)
    sizes = sorted({padded_rows(n) for n in range(1, warm_rows + 1)})
    with torch.inference_mode():
        for layer in shapes.values():
            for rows in sizes:
                layer(torch.zeros(rows, layer.in_features))
    return len(targets)
