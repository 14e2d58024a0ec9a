"""Pieces shared by the decoder and the vision tower: RMSNorm and multi-axis rotary positions.

Rotary positions here always have several components (C, T): the decoder passes (t, h, w)
(M-RoPE, Qwen2-VL style; plain RoPE passes three equal rows), the vision tower passes
(row, col). Each frequency pair of a head is driven by one component, chosen by a
``pair_component`` index vector built from the section sizes. The table holds cos/sin as
real pairs, built once in the model's ``setup_caches``; a step's rotations are picked from
it once and viewed as complex numbers, so that rotating q and k in each layer is one
complex multiply (a fifth to a half of the time of the same rotation spelled out in real
multiplies and a stack, which each layer paid twice: ~16 small ops per call).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from worker_svc.cpu_ops import CpuOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # The compiled pass where the model's caches were set up on the CPU in float32.
        self.ops: CpuOps | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x.contiguous(), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(x + residual, its norm): the residual stream and the next sublayer's input.
        x must be the caller's own fresh tensor: the compiled pass sums into it."""
        if self.ops is not None:
            x = x.contiguous()  # a padded GEMM's output is a column slice
            return x, self.ops.rms_norm(x, self.weight, self.eps, residual.contiguous())
        h = x + residual
        return h, self(h)


def rotary_table(n_pairs: int, max_pos: int, theta: float, device: torch.device,
                 llama3: tuple[float, float, float, int] | None = None) -> Tensor:
    """cos/sin of every (position, pair): (max_pos, n_pairs, 2), float32; ``llama3``
    rescales the frequencies (``llama3_frequencies``)."""
    inv_freq = 1.0 / theta ** (torch.arange(n_pairs, dtype=torch.float64) / n_pairs)
    if llama3 is not None:
        inv_freq = llama3_frequencies(inv_freq, *llama3)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)  # (S, P)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float().to(device)


def pair_components(sections: tuple[int, ...], device: torch.device) -> Tensor:
    """Position component driving each frequency pair, e.g. (2, 1, 1) -> [0, 0, 1, 2]."""
    return torch.repeat_interleave(
        torch.arange(len(sections), device=device), torch.tensor(sections, device=device)
    )


def llama3_frequencies(inv_freq: Tensor, factor: float, low_freq_factor: float,
                       high_freq_factor: float, original_context: int) -> Tensor:
    """Llama 3.1's long-context RoPE: wavelengths longer than ``original_context /
    low_freq_factor`` are stretched by ``factor``, those shorter than ``original_context /
    high_freq_factor`` kept, and the band between interpolated linearly in 1/wavelength."""
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    between = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > original_context / low_freq_factor, inv_freq / factor,
                       torch.where(wavelen < original_context / high_freq_factor, inv_freq,
                                   between))


def axial_rotary(head_dim: int, max_grid: int, theta: float,
                 device: torch.device) -> tuple[Tensor, Tensor]:
    """The 2-D rotary of a vision tower: (table (G, D/2, 2), components (D/2,)). Half the
    pairs follow the row, half the column, each half with the same frequency spectrum."""
    half = head_dim // 4
    table = rotary_table(half, max_grid, theta, device)  # (G, half, 2)
    return torch.cat([table, table], dim=1), pair_components((half, half), device)


def rotary_for_positions(table: Tensor, positions: Tensor, components: Tensor) -> Tensor:
    """The rotation of each token's pairs: positions (C, T) -> (T, n_pairs) complex64,
    cos + i sin."""
    # No range asserts here: they would sync with the device. The runner checks positions
    # against max_seq_len on the host before building the batch.
    t = positions.shape[1]
    per_component = table[positions]  # (C, T, P, 2)
    index = components.view(1, 1, -1, 1).expand(1, t, -1, 2)  # (1, T, P, 2)
    return torch.view_as_complex(per_component.gather(0, index).squeeze(0))  # (T, P)


def apply_rotary(x: Tensor, rot: Tensor) -> Tensor:
    """Rotate interleaved pairs (2i, 2i+1) of x (T, H, D) by rot (T, D/2) complex:
    (x0 + i x1) (cos + i sin) = (x0 cos - x1 sin) + i (x1 cos + x0 sin)."""
    t, h, d = x.shape
    pairs = torch.view_as_complex(x.float().reshape(t, h, d // 2, 2))  # (T, H, P)
    return torch.view_as_real(pairs * rot[:, None, :]).flatten(2).type_as(x)  # (T, H, D)
