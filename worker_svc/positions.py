"""Rotary positions of a request's tokens: plain RoPE or M-RoPE (Qwen2-VL style).

Positions have three components (t, h, w). Text tokens get t = h = w = the running
position. An image whose merged grid is (1, H, W), starting at running position b, gets
t = b, h = b + row, w = b + col over its H*W placeholder tokens in raster order, and the
running position jumps to b + max(H, W). Under plain RoPE every component is the token
index. Tokens generated later continue from the running position after the last known one.

Example (M-RoPE), text "ab", a 2x3 image, text "c"::

    token   a  b  I  I  I  I  I  I  c
    t       0  1  2  2  2  2  2  2  5
    h       0  1  2  2  2  3  3  3  5
    w       0  1  2  3  4  2  3  4  5
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ImageSpan:
    """Placeholder tokens of one image and its merged grid (H rows x W cols = length)."""

    offset: int
    grid_h: int
    grid_w: int

    @property
    def end(self) -> int:
        return self.offset + self.grid_h * self.grid_w


def rope_positions(num_tokens: int) -> tuple[Tensor, int]:
    """(3, n) positions equal to the token index, and the next position."""
    return torch.arange(num_tokens).expand(3, num_tokens).clone(), num_tokens


def mrope_positions(num_tokens: int, images: Sequence[ImageSpan]) -> tuple[Tensor, int]:
    """(3, n) M-RoPE positions of ``num_tokens`` tokens holding ``images`` (sorted, disjoint,
    inside the tokens), and the running position after them."""
    pos = torch.empty(3, num_tokens, dtype=torch.int64)
    cursor, running = 0, 0  # token index, running position
    for img in images:
        assert cursor <= img.offset and img.end <= num_tokens, "images sorted and inside"
        text = img.offset - cursor
        pos[:, cursor:img.offset] = running + torch.arange(text)
        running += text
        rows = torch.arange(img.grid_h).repeat_interleave(img.grid_w)  # (H*W,)
        cols = torch.arange(img.grid_w).repeat(img.grid_h)  # (H*W,)
        pos[0, img.offset:img.end] = running
        pos[1, img.offset:img.end] = running + rows
        pos[2, img.offset:img.end] = running + cols
        running += max(img.grid_h, img.grid_w)
        cursor = img.end
    pos[:, cursor:] = running + torch.arange(num_tokens - cursor)
    return pos, running + num_tokens - cursor
