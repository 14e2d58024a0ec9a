"""Linear layers whose weights are prepacked once for the CPU's GEMM (oneDNN), at load.

``F.linear`` on the CPU hands each call to MKL's sgemm, which re-lays the weight matrix out
for its kernel on every call. At serving sizes (a decode step multiplies 1-64 rows by each
weight) that per-call packing, over weights streamed from memory, is most of the GEMM's
time. oneDNN can take the weight in its kernel's blocked layout once
(``torch.ops.mkldnn._reorder_linear_weight``, the packing inductor's CPU freezing pass
uses) and multiply by it directly. Measured on SmolLM2-135M's decode GEMMs, weights
streamed from DRAM, 2 AVX2 cores: 0.41-0.75x the time of ``F.linear`` at 1 to 512 rows
(docs/worker.md, "Where a decode step's time goes").

The packed weight is an opaque tensor: it has no strides, no storage Python can read, and
cannot be deep-copied or moved to another device. So packing is the last step of loading a
serving model (after the tensor-parallel shard is cut, before hooks attach), only on the
CPU in float32, and ``state_dict`` users (export, tests of the loaders) work on the model
before it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# oneDNN picks its blocking for this many rows; the measured times at 1 and 512 rows
# hardly differ between hints of 16 and 64.
BATCH_HINT = 16


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a weight in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(
            linear.weight.detach(), BATCH_HINT), persistent=False)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Float32 on a CPU with oneDNN (every x86-64 and aarch64 torch build)."""
    return (device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available())


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear`` when its weights are
    float32 on the CPU; returns how many were replaced (0 elsewhere: CUDA, bf16)."""
    first = next(model.parameters())
    if not can_pack(first.device, first.dtype):
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
