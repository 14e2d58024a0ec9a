"""Image input processing: decode, resize to a patch grid, normalise, cut into patches.

The output layout is a contract with the worker's vision tower:

* ``pixel_values``: float32, shape ``(h * w, 3 * T * P * P)``: one row per patch, each
  flattened in ``(C, T, P, P)`` order, the still image repeated over the ``T =
  temporal_patch_size`` frames (1 for the built-in models, 2 for Qwen2-VL, whose patch
  embedding is a Conv3d over two frames); values ``(x * rescale_factor - mean) / std``;
* patch order: ``raster`` over the ``(h, w)`` grid (built-in models), or
  ``merge_window``: the ``merge_size x merge_size`` patches of one merged token
  consecutive, windows in raster order (Qwen2-VL's merger takes 4 consecutive rows);
* ``image_grid_thw``: int64, shape ``(1, 3)`` = ``[[1, h, w]]``, with ``h`` and ``w``
  multiples of ``merge_size``, kept on CPU;
* the image takes ``h * w // merge_size**2`` placeholder tokens (after the merge).

For a Qwen2-VL / Qwen2.5-VL checkpoint (:meth:`ImageProcessorConfig.from_pretrained_dir`)
the grid and the pixels of an encoded image are bit-identical to transformers'
``Qwen2VLImageProcessorPil`` (the PIL backend; v4's ``Qwen2VLImageProcessor``): the same
smart resize, the same PIL resample of the 8-bit RGB image, transparency composited on
white, then the same float64 rescale and float32 normalisation. The built-in presets'
output is unchanged by those settings (their defaults reproduce it exactly).

Every rejection of client data raises :class:`tandem.errors.InvalidInput` with a message
for the client; a bad configuration raises ``ValueError`` at construction, and a bad
``preprocessor_config.json`` ``InvalidInput`` naming the file and key.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from tandem.errors import InvalidInput
from tandem.text.model_files import bad_key, read_json

# Same bound as Qwen2-VL: beyond it one side would shrink to a single merged patch.
MAX_ASPECT_RATIO = 200
# Content hashes change whenever the processing below changes meaning.
_HASH_VERSION = b"tandem.image.v1"
_MAGIC = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG"}
_FLOAT_DTYPES = (np.float16, np.float32, np.float64)
PREPROCESSOR_FILE = "preprocessor_config.json"
PatchOrder = Literal["raster", "merge_window"]
# transformers' names of the Qwen2-VL image processor (Qwen2.5-VL uses the same one).
_QWEN2_VL_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast",
                        "Qwen2VLImageProcessorPil")
_RESAMPLES = {int(r) for r in Image.Resampling}


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
    temporal_patch_size: int = 1
    patch_order: PatchOrder = "raster"
    resample: int = Image.Resampling.BICUBIC  # a PIL resampling filter
    rescale_factor: float = 1 / 255  # 8-bit values times this; then (x - mean) / std
    # RGB that transparent pixels are composited on; None: drop the alpha channel.
    alpha_background: tuple[int, int, int] | None = None

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
        if self.temporal_patch_size < 1:
            raise ValueError("temporal_patch_size must be positive")
        if self.patch_order not in ("raster", "merge_window"):
            raise ValueError(f"patch_order must be raster or merge_window, got {self.patch_order}")
        if self.resample not in _RESAMPLES:
            raise ValueError(f"resample must be a PIL filter {sorted(_RESAMPLES)}, "
                             f"got {self.resample}")
        if not self.rescale_factor > 0:
            raise ValueError("rescale_factor must be positive")
        bg = self.alpha_background
        if bg is not None and (len(bg) != 3 or not all(0 <= v <= 255 for v in bg)):
            raise ValueError("alpha_background must be 3 values in 0..255")

    @property
    def factor(self) -> int:
        """Pixels per side of one merged patch: resized sides are multiples of it."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_pretrained_dir(cls, model_dir: str | Path) -> ImageProcessorConfig:
        """The processing of a Qwen2-VL / Qwen2.5-VL checkpoint's ``preprocessor_config.json``.

        Keys absent from the file take the values transformers' processor class
        defaults to (patch 14, merge 2, temporal patch 2, 56*56..28*28*1280 pixels, CLIP
        mean and std, bicubic, 1/255). ``min_pixels``/``max_pixels`` win over
        ``size.shortest_edge``/``size.longest_edge`` (both are pixel counts). The limits
        on what clients send keep their defaults: replace them with
        ``dataclasses.replace``.
        """
        path = Path(model_dir) / PREPROCESSOR_FILE
        raw = read_json(path, required=True)
        assert raw is not None  # required=True raises instead
        kind = raw.get("image_processor_type")
        if kind not in _QWEN2_VL_PROCESSORS:
            raise bad_key(path, "image_processor_type",
                          f"is {kind!r}; Tandem supports {', '.join(_QWEN2_VL_PROCESSORS)}")
        for flag in ("do_resize", "do_convert_rgb"):
            if raw.get(flag, True) is not True:
                raise bad_key(path, flag, "must be true (Tandem always resizes to whole "
                                          "patches and converts to RGB)")
        size = raw.get("size") or {}
        if not isinstance(size, dict):
            raise bad_key(path, "size", "must be an object")
        do_rescale = _get(path, raw, "do_rescale", bool, True)
        do_normalize = _get(path, raw, "do_normalize", bool, True)
        mean = _get(path, raw, "image_mean", list, list(_CLIP_MEAN))
        std = _get(path, raw, "image_std", list, list(_CLIP_STD))
        try:
            return cls(
                patch_size=_get(path, raw, "patch_size", int, 14),
                merge_size=_get(path, raw, "merge_size", int, 2),
                temporal_patch_size=_get(path, raw, "temporal_patch_size", int, 2),
                min_pixels=_get(path, raw, "min_pixels", int,
                                _get(path, size, "shortest_edge", int, 56 * 56, "size.")),
                max_pixels=_get(path, raw, "max_pixels", int,
                                _get(path, size, "longest_edge", int, 28 * 28 * 1280, "size.")),
                mean=tuple(mean) if do_normalize else (0.0, 0.0, 0.0),  # type: ignore[arg-type]
                std=tuple(std) if do_normalize else (1.0, 1.0, 1.0),  # type: ignore[arg-type]
                resample=_get(path, raw, "resample", int, int(Image.Resampling.BICUBIC)),
                rescale_factor=(_get(path, raw, "rescale_factor", float, 1 / 255)
                                if do_rescale else 1.0),
                patch_order="merge_window", alpha_background=(255, 255, 255))
        except ValueError as exc:  # the dataclass's own checks, now about the file
            raise InvalidInput(f"{path}: {exc}", "BAD_MODEL") from exc


def decode_image(data: bytes, limits: ImageProcessorConfig) -> Image.Image:
    """An RGB image from PNG or JPEG bytes, refusing oversized, unknown or corrupt input.

    Transparency is composited on ``limits.alpha_background`` when set (as transformers'
    ``convert_to_rgb`` does on white), else the alpha channel is dropped.
    """
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
    if img.mode == "RGB":
        return img
    bg = limits.alpha_background
    if bg is not None and ("A" in img.getbands() or img.info.get("transparency") is not None):
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (*bg, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def smart_resize(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """Target ``(height, width)``: multiples of ``cfg.factor``, about the same aspect ratio.

    Qwen2-VL's rule, step for step: round each side to the nearest multiple (a side
    under half a merged patch rounds to 0); if that area is over ``max_pixels`` scale
    both sides down by one factor and floor (at least one merged patch), if under
    ``min_pixels`` scale up and ceil. So a 10x1000 image becomes 28x560, not 28x1008.

    NOTE: one departure, kept on purpose: where that rule lands over ``max_pixels``
    (only when a side clamped to one merged patch, at aspect ratios beyond
    ``max_pixels / factor**2``: never with Qwen's shipped configs) the longer side is cut
    back, because the scheduler's token budget relies on the maximum.
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
    h, w = round(height / f) * f, round(width / f) * f
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
    public API's raw tensor path), which are resized in float without quantising and
    not rescaled (they are in [0, 1] already).
    """
    rgb = _resized_rgb(image, cfg) if isinstance(image, Image.Image) else _resized_array(image, cfg)
    height, width, _ = rgb.shape
    p, t = cfg.patch_size, cfg.temporal_patch_size
    g = cfg.merge_size if cfg.patch_order == "merge_window" else 1  # patches kept together
    h, w = height // p, width // p
    x = torch.from_numpy(rgb)  # (H, W, C)
    x = (x - torch.tensor(cfg.mean)) / torch.tensor(cfg.std)
    x = x.view(h // g, g, p, w // g, g, p, 3)  # (h/g, g, P, w/g, g, P, C)
    x = x.permute(0, 3, 1, 4, 6, 2, 5)  # (h/g, w/g, g, g, C, P, P)
    x = x.unsqueeze(5).expand(*x.shape[:5], t, p, p)  # (h/g, w/g, g, g, C, T, P, P)
    pixel_values = x.reshape(h * w, 3 * t * p * p).to(torch.float32)  # (h*w, C*T*P*P)
    image_grid_thw = torch.tensor([[1, h, w]], dtype=torch.int64)  # (1, 3)
    return pixel_values, image_grid_thw


def num_image_tokens(image_grid_thw: torch.Tensor, merge_size: int) -> int:
    """Placeholder tokens of one image: its patches after the ``merge_size``-square merge."""
    shape = tuple(image_grid_thw.shape)
    assert shape == (1, 3), f"image_grid_thw must be (1, 3), got {shape}"
    t, h, w = (int(v) for v in image_grid_thw[0])
    return t * h * w // (merge_size * merge_size)


def _resized_rgb(img: Image.Image, cfg: ImageProcessorConfig) -> np.ndarray:
    """(H, W, 3) float32 values times ``rescale_factor``; resized as 8-bit RGB.

    The rescale is float64 then rounded to float32, as transformers does; for 1/255 it
    equals a float32 division for all 256 values, so the built-in output is unchanged.
    """
    rgb = img if img.mode == "RGB" else img.convert("RGB")
    height, width = smart_resize(rgb.height, rgb.width, cfg)
    if (height, width) != (rgb.height, rgb.width):
        rgb = rgb.resize((width, height), Image.Resampling(cfg.resample))
    return (np.asarray(rgb, dtype=np.float64) * cfg.rescale_factor).astype(np.float32)


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
                (width, height), Image.Resampling(cfg.resample)
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
    settings = repr((
        cfg.patch_size, cfg.merge_size, cfg.min_pixels, cfg.max_pixels, cfg.mean, cfg.std,
        cfg.temporal_patch_size, cfg.patch_order, cfg.resample, cfg.rescale_factor,
        cfg.alpha_background,
    )).encode()
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


_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _get(path: Path, raw: dict[str, Any], key: str, kind: type, default: Any,
         prefix: str = "") -> Any:
    """``raw[key]`` checked to be a ``kind`` (ints accepted as floats), else ``default``."""
    value = raw.get(key)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if kind is list:
        ok = ok and len(value) == 3 and all(isinstance(v, int | float) for v in value)
    if not ok:
        wanted = "3 numbers" if kind is list else kind.__name__
        raise bad_key(path, prefix + key, f"must be {wanted}, got {value!r}")
    return value


def _digest(*parts: bytes | memoryview) -> str:
    """sha256 hex over length-prefixed parts: no two part lists hash the same bytes."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()
