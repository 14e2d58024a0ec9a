"""Linear layers whose weights are prepacked once for the CPU's GEMM (oneDNN), at load.

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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


def pack_linears(model: nn.Module, warm_rows: int = WARM_ROWS) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear`` when its weights are
    float32 on the CPU, and build the GEMM primitives of every padded size up to
    ``warm_rows`` now; returns how many layers were replaced (0 elsewhere: CUDA, bf16).

    NOTE: built at load rather than when a size first comes: a primitive's buffers would
    otherwise grow the worker after its warm-up (the soak test's flat-RSS check), and the
    first request of each size would pay for building them. Layers of one shape share
    their primitives, so one layer per shape is run."""
    first = next(model.parameters())
    if not can_pack(first.device, first.dtype):
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
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
