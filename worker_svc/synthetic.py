"""A seeded synthetic image in the processor's format: the worker's warm-up input (tests and
benchmarks use it too, through ``tandem_testing.scripted``).

The image is what the scheduler's processor would send: ``pixel_values`` (h*w, C*P*P) and
``image_grid_thw`` [[1, h, w]] (``keep_on_cpu``).
"""

from __future__ import annotations

import torch

from tandem.features import FieldElem, MultiModalKwargsItem
from worker_svc.model_config import ModelConfig
from worker_svc.request_state import IMAGE_GRID_THW, PIXEL_VALUES


def synthetic_image(config: ModelConfig, grid_h: int, grid_w: int,
                    seed: int) -> MultiModalKwargsItem:
    """A normalised-looking random image of grid_h x grid_w patches."""
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(grid_h * grid_w, config.patch_dim, generator=gen)
    grid = torch.tensor([[1, grid_h, grid_w]], dtype=torch.int64)
    return MultiModalKwargsItem({PIXEL_VALUES: FieldElem(pixels),
                                 IMAGE_GRID_THW: FieldElem(grid, keep_on_cpu=True)})
