"""Vision towers of Qwen2-VL and Qwen2.5-VL, with their checkpoints' parameter names.

Input is one still image as ``Qwen2VLImageProcessor`` lays it out: ``pixel_values`` (h*w,
C*T*P*P), rows in merge-block order (the m x m patches of each merged unit consecutive,
raster inside the unit; units raster over the (h/m, w/m) grid), each row a (C, T, P, P)
patch whose T frames repeat the image. Output is one embedding of the decoder width per
merged unit, raster over (h/m, w/m): one per ``<|image_pad|>`` token.

Both towers: a patch embedding (the checkpoint's Conv3d with kernel = stride = (T, P, P),
which over one flattened patch is a Linear; ``hf_checkpoint.py`` views its weight so),
pre-norm blocks with fused-qkv attention (biased) over the whole image and 2-D rotary
positions (theta 10000, half the pairs per axis, ``layers.axial_rotary``), and a merger:
norm ``ln_q``, the m*m patches of a unit concatenated, Linear -> GELU -> Linear.
Qwen2-VL: LayerNorm with bias, MLP fc1 -> activation (quick-GELU) -> fc2. Qwen2.5-VL:
RMSNorm, gated MLP with biases (down(act(gate(x)) * up(x))), and window attention: blocks
outside ``vision_full_attention_blocks`` attend only within windows of
``vision_window_size`` pixels a side.

NOTE: Qwen2.5-VL's reference reorders the whole sequence so that windows are contiguous
and restores the order after the merger. Here the sequence keeps its order and a windowed
block gathers each window's rows into a padded (windows, L) batch: every other operation is
per row, and attention within a window does not depend on row order, so the result is
the same without a sequence-wide permutation and its inverse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker_svc.layers import RMSNorm, apply_rotary, axial_rotary, rotary_for_positions
from worker_svc.model_config import ModelConfig

ROPE_THETA = 10000.0  # of both towers, fixed by the architecture (not in config.json)
NORM_EPS = 1e-6  # likewise, for every vision norm

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class Windows:
    """Rows of each attention window, padded to the longest window."""

    index: Tensor  # (G, L) rows of the image's sequence; padding repeats row 0
    mask: Tensor  # (G, 1, 1, L) bool, True = a real row of that window


def block_major_grid(grid_h: int, grid_w: int, m: int) -> tuple[Tensor, Tensor]:
    """(row, col) of each patch (N,), in the processor's merge-block order."""
    shape = (grid_h // m, m, grid_w // m, m)
    rows = torch.arange(grid_h).view(grid_h // m, m, 1, 1).expand(shape)  # (H', m, W', m)
    cols = torch.arange(grid_w).view(1, 1, grid_w // m, m).expand(shape)  # (H', m, W', m)
    return rows.permute(0, 2, 1, 3).flatten(), cols.permute(0, 2, 1, 3).flatten()  # (N,)


def window_groups(grid_h: int, grid_w: int, m: int, units_per_side: int) -> Windows:
    """Windows of ``units_per_side``^2 merged units, raster over the image (partial at the
    right and bottom edges), on the CPU."""
    hm, wm, s = grid_h // m, grid_w // m, units_per_side
    unit = torch.arange(hm * wm)  # merged units, raster
    window = (unit // wm) // s * -(-wm // s) + (unit % wm) // s  # (U,) window of each unit
    window = window.repeat_interleave(m * m)  # (N,) a unit's patches are consecutive rows
    counts = torch.bincount(window)  # (G,) every window holds at least one unit
    order = torch.argsort(window, stable=True)  # (N,) rows grouped by window
    index = nn.utils.rnn.pad_sequence(list(order.split(counts.tolist())), batch_first=True)
    mask = torch.arange(index.shape[1]) < counts[:, None]  # (G, L)
    return Windows(index, mask[:, None, None, :])


class PatchEmbed(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(config.patch_dim, config.vision_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)  # (N, vision_dim)


class VisionAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.vision_heads, config.vision_head_dim
        self.qkv = nn.Linear(config.vision_dim, 3 * config.vision_dim)
        self.proj = nn.Linear(config.vision_dim, config.vision_dim)

    def forward(self, x: Tensor, rot: Tensor, windows: Windows | None) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.n_heads, self.head_dim).unbind(1)  # 3 x (N, H, D)
        q, k = apply_rotary(q, rot), apply_rotary(k, rot)
        if windows is None:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
        else:
            out = _windowed_attention(q, k, v, windows)  # (N, H, D)
        return self.proj(out.reshape(n, -1))  # (N, vision_dim)


def _windowed_attention(q: Tensor, k: Tensor, v: Tensor, w: Windows) -> Tensor:
    """Each window's rows attend among themselves; q, k, v and the result are (N, H, D)."""
    def gather(t: Tensor) -> Tensor:
        return t[w.index].transpose(1, 2)  # (G, H, L, D)

    o = F.scaled_dot_product_attention(gather(q), gather(k), gather(v), attn_mask=w.mask)
    keep = w.mask.view(w.index.shape)  # (G, L)
    out = torch.empty_like(q)
    out[w.index[keep]] = o.transpose(1, 2)[keep]  # padded query rows are dropped
    return out


class VisionMLP(nn.Module):
    """Qwen2-VL: fc1 -> activation -> fc2."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.act = ACTIVATIONS[config.vision_act]
        self.fc1 = nn.Linear(config.vision_dim, config.vision_intermediate_size)
        self.fc2 = nn.Linear(config.vision_intermediate_size, config.vision_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMLP(nn.Module):
    """Qwen2.5-VL: down(act(gate(x)) * up(x)), all with biases."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.act = ACTIVATIONS[config.vision_act]
        self.gate_proj = nn.Linear(config.vision_dim, config.vision_intermediate_size)
        self.up_proj = nn.Linear(config.vision_dim, config.vision_intermediate_size)
        self.down_proj = nn.Linear(config.vision_intermediate_size, config.vision_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _norm(config: ModelConfig, dim: int) -> nn.Module:
    if config.model_type == "qwen2_vl":
        return nn.LayerNorm(dim, eps=NORM_EPS)
    return RMSNorm(dim, NORM_EPS)


class VisionBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm1 = _norm(config, config.vision_dim)
        self.norm2 = _norm(config, config.vision_dim)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config) if config.model_type == "qwen2_vl" else VisionGatedMLP(
            config)

    def forward(self, x: Tensor, rot: Tensor, windows: Windows | None) -> Tensor:
        x = x + self.attn(self.norm1(x), rot, windows)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.width = config.vision_dim * config.merge_size**2
        self.ln_q = _norm(config, config.vision_dim)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, config.dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))  # (N/m^2, dim)


class QwenVisionEncoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.vision_layers))
        self.merger = PatchMerger(config)
        self.rope: Tensor | None = None
        self.rope_components: Tensor | None = None

    def setup_caches(self, device: torch.device) -> None:
        c = self.config
        self.rope, self.rope_components = axial_rotary(c.vision_head_dim, c.vision_max_grid,
                                                       ROPE_THETA, device)

    def forward(self, pixel_values: Tensor, grid_h: int, grid_w: int) -> Tensor:
        """pixel_values (h*w, C*T*P*P) -> embeddings (h*w/m^2, dim), raster over the merge.

        The runner has checked the shapes against the config (request_state.py)."""
        c = self.config
        assert self.rope is not None and self.rope_components is not None, "call setup_caches"
        assert pixel_values.shape == (grid_h * grid_w, c.patch_dim), "checked by the runner"
        dev, m = pixel_values.device, c.merge_size
        rows, cols = block_major_grid(grid_h, grid_w, m)
        rot = rotary_for_positions(self.rope, torch.stack([rows, cols]).to(dev),
                                   self.rope_components)  # (N, D/2) complex
        windows = None
        if c.vision_window_size:
            w = window_groups(grid_h, grid_w, m, c.vision_window_size // (m * c.patch_size))
            windows = Windows(w.index.to(dev), w.mask.to(dev))
        x = self.patch_embed(pixel_values)
        for i, block in enumerate(self.blocks):
            x = block(x, rot, None if i in c.vision_full_attention_blocks else windows)
        return self.merger(x)
