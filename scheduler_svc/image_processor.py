"""Image input processing: decode, resize to a patch grid, normalise, cut into patches.

The output layout is a contract with the worker's vision tower:

* ``pixel_values``: float32, shape ``(h * w, 3 * P * P)``: one row per patch, patches in
  raster order over the ``(h, w)`` patch grid, each patch flattened in ``(C, P, P)``
  order, values ``(x - mean) / std`` of RGB in [0, 1];
* ``image_grid_thw``: int64, shape ``(1, 3)`` = ``[[1, h, w]]``, with ``h`` and ``w``
  even (multiples of ``merge_size``), kept on CPU;
* the image takes ``h * w // merge_size**2`` placeholder tokens (after the 2x2 merge).

Every rejection of client data raises :class:`tandem.errors.InvalidInput` with a message
for the client; a bad configuration raises ``ValueError`` at construction.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from tandem.errors import InvalidInput

# Same bound as Qwen2-VL: beyond it one side would shrink to a single merged patch.
MAX_ASPECT_RATIO = 200
# Content hashes change whenever the processing below changes meaning.
_HASH_VERSION = b"tandem.image.v1"
_MAGIC = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG"}
_FLOAT_DTYPES = (np.float16, np.float32, np.float64)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """How images become patches, and the limits on what clients may send.

    The default pixel bounds give 4..256 image tokens per image (56x56..448x448 pixels).
    ``max_image_pixels`` bounds the *decoded* size, checked from the header before
    decoding, so a small file that expands to a huge bitmap is refused cheaply.
    """

    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096

    def __post_init__(self) -> None:
        factor = self.patch_size * self.merge_size
        if self.patch_size < 1 or self.merge_size < 1:
            raise ValueError("patch_size and merge_size must be positive")
        if not factor * factor <= self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"need {factor * factor} <= min_pixels <= max_pixels, "
                f"got {self.min_pixels}, {self.max_pixels}"
            )
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ValueError("mean and std need 3 values each, std positive")
        if self.max_image_bytes < 1 or self.max_image_pixels < 1:
            raise ValueError("max_image_bytes and max_image_pixels must be positive")

    @property
    def factor(self) -> int:
        """Pixels per side of one merged patch: resized sides are multiples of it."""
        return self.patch_size * self.merge_size


def decode_image(data: bytes, limits: ImageProcessorConfig) -> Image.Image:
    """An RGB image from PNG or JPEG bytes, refusing oversized, unknown or corrupt input."""
    if len(data) > limits.max_image_bytes:
        raise InvalidInput(
            f"image is {len(data)} bytes; the limit is {limits.max_image_bytes}",
            reason="IMAGE_TOO_LARGE",
        )
    fmt = next((f for magic, f in _MAGIC.items() if data.startswith(magic)), None)
    if fmt is None:
        raise InvalidInput(
            "unsupported image format: PNG and JPEG are accepted", reason="IMAGE_FORMAT"
        )
    try:
        img = Image.open(io.BytesIO(data), formats=(fmt,))
        width, height = img.size
        if width * height > limits.max_image_pixels:
            raise InvalidInput(
                f"image is {width}x{height} pixels; the limit is {limits.max_image_pixels} pixels",
                reason="IMAGE_TOO_LARGE",
            )
        img.load()
    except InvalidInput:
        raise
    except Image.DecompressionBombError as exc:
        raise InvalidInput(
            f"image exceeds {limits.max_image_pixels} pixels", reason="IMAGE_TOO_LARGE"
        ) from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise InvalidInput(f"{fmt} image is corrupt or truncated", reason="IMAGE_CORRUPT") from exc
    return img if img.mode == "RGB" else img.convert("RGB")


def smart_resize(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """Target ``(height, width)``: multiples of ``cfg.factor``, about the same aspect ratio.

    Rounds each side to the nearest multiple; if the area leaves ``[min_pixels,
    max_pixels]`` both sides are scaled by one factor first. The area never exceeds
    ``max_pixels``; it reaches ``min_pixels`` unless that would break the maximum.
    """
    f = cfg.factor
    if height < 1 or width < 1:
        raise InvalidInput(f"image of {height}x{width} pixels is empty", reason="IMAGE_EMPTY")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidInput(
            f"image aspect ratio {max(height, width) / min(height, width):.0f} exceeds "
            f"{MAX_ASPECT_RATIO}",
            reason="IMAGE_ASPECT_RATIO",
        )
    h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
    if h * w > cfg.max_pixels:
        beta = math.sqrt(height * width / cfg.max_pixels)
        h = max(f, math.floor(height / beta / f) * f)
        w = max(f, math.floor(width / beta / f) * f)
    elif h * w < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    # Rounding (or a side clamped to one merged patch) can overshoot the maximum.
    while h * w > cfg.max_pixels:
        if h >= w:
            h -= f
        else:
            w -= f
    return h, w


def process_image(
    image: Image.Image | np.ndarray, cfg: ImageProcessorConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values, image_grid_thw)`` in the layout of the module docstring.

    ``image`` is a decoded image, or float pixels shaped ``(H, W, 3)`` in [0, 1] (the
    public API's raw tensor path), which are resized in float without quantising.
    """
    rgb = _resized_rgb(image, cfg) if isinstance(image, Image.Image) else _resized_array(image, cfg)
    height, width, _ = rgb.shape
    p = cfg.patch_size
    h, w = height // p, width // p
    x = torch.from_numpy(rgb)  # (H, W, C)
    x = (x - torch.tensor(cfg.mean)) / torch.tensor(cfg.std)
    x = x.view(h, p, w, p, 3)  # (h, P, w, P, C)
    x = x.permute(0, 2, 4, 1, 3)  # (h, w, C, P, P)
    pixel_values = x.reshape(h * w, 3 * p * p).to(torch.float32)  # (h*w, C*P*P)
    image_grid_thw = torch.tensor([[1, h, w]], dtype=torch.int64)  # (1, 3)
    return pixel_values, image_grid_thw


def num_image_tokens(image_grid_thw: torch.Tensor, merge_size: int) -> int:
    """Placeholder tokens of one image: its patches after the ``merge_size``-square merge."""
    shape = tuple(image_grid_thw.shape)
    assert shape == (1, 3), f"image_grid_thw must be (1, 3), got {shape}"
    t, h, w = (int(v) for v in image_grid_thw[0])
    return t * h * w // (merge_size * merge_size)


def _resized_rgb(img: Image.Image, cfg: ImageProcessorConfig) -> np.ndarray:
    """(H, W, 3) float32 in [0, 1]; resized as 8-bit RGB (fast, as decoded files are)."""
    rgb = img if img.mode == "RGB" else img.convert("RGB")
    height, width = smart_resize(rgb.height, rgb.width, cfg)
    if (height, width) != (rgb.height, rgb.width):
        rgb = rgb.resize((width, height), Image.Resampling.BICUBIC)
    return np.asarray(rgb, dtype=np.float32) / 255.0


def _resized_array(pixels: np.ndarray, cfg: ImageProcessorConfig) -> np.ndarray:
    """(H, W, 3) float32 in [0, 1] from validated float pixels, each channel resized alone."""
    _check_pixels(pixels, cfg)
    height, width = smart_resize(pixels.shape[0], pixels.shape[1], cfg)
    src = pixels.astype(np.float32, copy=False)
    if (height, width) == src.shape[:2]:
        return np.ascontiguousarray(src)
    channels = [
        np.asarray(
            Image.fromarray(np.ascontiguousarray(src[:, :, c])).resize(
                (width, height), Image.Resampling.BICUBIC
            )
        )
        for c in range(3)
    ]
    # Bicubic overshoots at edges; clip like the 8-bit path does.
    return np.clip(np.stack(channels, axis=-1), 0.0, 1.0)


def _check_pixels(pixels: np.ndarray, cfg: ImageProcessorConfig) -> None:
    if not isinstance(pixels, np.ndarray) or pixels.dtype not in _FLOAT_DTYPES:
        kind = getattr(pixels, "dtype", type(pixels).__name__)
        raise InvalidInput(
            f"image tensor must be float16, float32 or float64, got {kind}",
            reason="IMAGE_TENSOR",
        )
    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise InvalidInput(
            f"image tensor must be shaped (height, width, 3), got {tuple(pixels.shape)}",
            reason="IMAGE_TENSOR",
        )
    if pixels.shape[0] * pixels.shape[1] > cfg.max_image_pixels:
        raise InvalidInput(
            f"image is {pixels.shape[1]}x{pixels.shape[0]} pixels; the limit is "
            f"{cfg.max_image_pixels} pixels",
            reason="IMAGE_TOO_LARGE",
        )
    if pixels.size == 0:
        raise InvalidInput(f"image tensor {tuple(pixels.shape)} is empty", reason="IMAGE_EMPTY")
    in_range = np.isfinite(pixels).all() and pixels.min() >= 0 and pixels.max() <= 1
    if not in_range:
        raise InvalidInput(
            "image tensor values must be finite and in [0, 1]", reason="IMAGE_TENSOR"
        )


def mm_hash(content: bytes | np.ndarray, cfg: ImageProcessorConfig, salt: str) -> str:
    """The processor-cache key of an image: sha256 hex of content, settings and salt.

    ``content`` is the encoded file, or the raw pixel array (hashed with its dtype and
    shape, since equal bytes can mean different images). The settings that change the
    output are included, so a reconfigured processor never reuses stale features; the
    salt keeps tenants' caches apart.
    """
    settings = repr(
        (cfg.patch_size, cfg.merge_size, cfg.min_pixels, cfg.max_pixels, cfg.mean, cfg.std)
    ).encode()
    if isinstance(content, np.ndarray):
        arr = np.ascontiguousarray(content)
        head = f"array:{arr.dtype.str}:{arr.shape}".encode()
        return _digest(_HASH_VERSION, settings, salt.encode(), head, memoryview(arr).cast("B"))
    return _digest(_HASH_VERSION, settings, salt.encode(), b"encoded", content)


def mm_hash_from_uuid(uuid: str, salt: str, grid: tuple[int, int]) -> str:
    """The processor-cache key of an image the client named: its uuid within the salt, and
    its resized (height, width), which fixes its placeholder count.

    NOTE: without the size, a uuid reused for an image of another size would hit an item
    whose patches do not match the request's placeholders: the workers refuse that step,
    which fails every request in flight on the cell, not just the offender's.
    """
    size = b"%dx%d" % grid
    return _digest(_HASH_VERSION, b"uuid", uuid.encode(), salt.encode(), size)


def _digest(*parts: bytes | memoryview) -> str:
    """sha256 hex over length-prefixed parts: no two part lists hash the same bytes."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()
