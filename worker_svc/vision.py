"""Vision tower of the built-in model: patch embedding, transformer blocks, 2x2 merge, projector.

Input is what the scheduler's processor produces for one image: ``pixel_values`` of shape
(h*w, C*P*P), patches in raster order over the (h, w) patch grid, each flattened in
(C, P, P) order and already normalised. A linear patch embedding over that flattening equals
a stride-P convolution. Attention is bidirectional over the image, with 2-D rotary positions
(half the frequency pairs follow the row, half the column). The merge concatenates patches
(2i, 2i+1) x (2j, 2j+1) row-major and projects them to the LM width, giving h*w/4 embeddings
in raster order over the merged (h/2, w/2) grid: one per placeholder token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker_svc.layers import RMSNorm, apply_rotary, axial_rotary, rotary_for_positions
from worker_svc.model_config import ModelConfig


class VisionAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.vision_heads, config.vision_head_dim
        self.qkv = nn.Linear(config.vision_dim, 3 * config.vision_dim)
        self.proj = nn.Linear(config.vision_dim, config.vision_dim)

    def forward(self, x: Tensor, rot: Tensor) -> Tensor:
        n, d = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.n_heads, self.head_dim).unbind(1)  # 3 x (N, H, D)
        q, k = apply_rotary(q, rot), apply_rotary(k, rot)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        )  # (H, N, D)
        return self.proj(out.transpose(0, 1).reshape(n, d))


class VisionBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.vision_dim, config.norm_eps)
        self.attn = VisionAttention(config)
        self.norm2 = RMSNorm(config.vision_dim, config.norm_eps)
        self.fc1 = nn.Linear(config.vision_dim, config.vision_intermediate_size)
        self.fc2 = nn.Linear(config.vision_intermediate_size, config.vision_dim)

    def forward(self, x: Tensor, rot: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), rot)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class PatchMerger(nn.Module):
    """2x2 neighbouring patches -> one embedding of the LM width."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.m = config.merge_size
        self.norm = RMSNorm(config.vision_dim, config.norm_eps)
        self.fc1 = nn.Linear(config.vision_dim * self.m**2, config.dim)
        self.fc2 = nn.Linear(config.dim, config.dim)

    def forward(self, x: Tensor, grid_h: int, grid_w: int) -> Tensor:
        m, d = self.m, x.shape[-1]
        x = self.norm(x).view(grid_h // m, m, grid_w // m, m, d)  # (H', m, W', m, D)
        x = x.permute(0, 2, 1, 3, 4).reshape(-1, m * m * d)  # (H'*W', m*m*D), row-major in 2x2
        return self.fc2(F.gelu(self.fc1(x)))  # (H'*W', dim)


class VisionEncoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Linear(config.patch_dim, config.vision_dim)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.vision_layers))
        self.merger = PatchMerger(config)
        self.rope: Tensor | None = None
        self.rope_components: Tensor | None = None

    def setup_caches(self, device: torch.device) -> None:
        """Rotary table over ``vision_max_grid`` rows/columns (``layers.axial_rotary``)."""
        c = self.config
        self.rope, self.rope_components = axial_rotary(c.vision_head_dim, c.vision_max_grid,
                                                       c.rope_theta, device)

    def forward(self, pixel_values: Tensor, grid_h: int, grid_w: int) -> Tensor:
        """pixel_values (h*w, C*P*P) -> embeddings (h*w/4, dim), raster order over the merge."""
        c = self.config
        assert self.rope is not None and self.rope_components is not None, "call setup_caches"
        assert pixel_values.shape == (grid_h * grid_w, c.patch_dim), (
            f"pixel_values {tuple(pixel_values.shape)} != ({grid_h}*{grid_w}, {c.patch_dim})"
        )
        assert grid_h % c.merge_size == 0 and grid_w % c.merge_size == 0, "grid must be even"
        assert max(grid_h, grid_w) <= c.vision_max_grid, f"grid over {c.vision_max_grid}"
        dev = pixel_values.device
        rows = torch.arange(grid_h, device=dev).repeat_interleave(grid_w)  # (N,)
        cols = torch.arange(grid_w, device=dev).repeat(grid_h)  # (N,)
        rot = rotary_for_positions(self.rope, torch.stack([rows, cols]), self.rope_components)
        x = self.patch_embed(pixel_values)  # (N, vision_dim)
        for block in self.blocks:
            x = block(x, rot)
        return self.merger(x, grid_h, grid_w)
