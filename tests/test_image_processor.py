"""Image decoding, resizing, the pixel_values layout contract, limits and mm hashes."""

from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from scheduler_svc.image_processor import (
    ImageProcessorConfig,
    decode_image,
    mm_hash,
    mm_hash_from_uuid,
    num_image_tokens,
    process_image,
    smart_resize,
)
from tandem.errors import InvalidInput

CFG = ImageProcessorConfig()


def _encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _gradient(height: int, width: int) -> Image.Image:
    """A smooth image: resampling it overshoots nowhere."""
    ys, xs = np.mgrid[0:height, 0:width]
    rgb = np.stack([xs * 255 / width, ys * 255 / height, (xs + ys) * 127 / (width + height)], -1)
    return Image.fromarray(rgb.astype(np.uint8), "RGB")


def _noise(height: int, width: int) -> Image.Image:
    """An incompressible image, so a cut file is really truncated."""
    rgb = np.random.default_rng(1).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(rgb, "RGB")


def _with_header_size(png: bytes, width: int, height: int) -> bytes:
    """The PNG with its IHDR claiming another size (CRC fixed): a decompression bomb."""
    ihdr = png[12:16] + struct.pack(">II", width, height) + png[24:29]
    return png[:16] + ihdr[4:] + struct.pack(">I", zlib.crc32(ihdr)) + png[33:]


def test_pixel_values_layout_is_raster_patches_in_cpp_order() -> None:
    p = CFG.patch_size
    rng = np.random.default_rng(0)
    pixels = rng.random((56, 84, 3), dtype=np.float32)  # already a valid size: no resize
    pixel_values, grid = process_image(pixels, CFG)
    assert pixel_values.dtype == torch.float32 and pixel_values.shape == (4 * 6, 3 * p * p)
    assert grid.dtype == torch.int64 and grid.tolist() == [[1, 4, 6]]
    assert num_image_tokens(grid, CFG.merge_size) == 6
    for i in range(4):
        for j in range(6):
            patch = pixels[i * p : (i + 1) * p, j * p : (j + 1) * p, :]  # (P, P, C)
            expected = ((patch - 0.5) / 0.5).transpose(2, 0, 1).reshape(-1)  # (C, P, P)
            np.testing.assert_allclose(pixel_values[i * 6 + j].numpy(), expected, rtol=1e-6)


def test_decoded_and_raw_pixels_agree() -> None:
    img = _gradient(56, 112)
    from_png, grid = process_image(decode_image(_encode(img, "PNG"), CFG), CFG)
    from_array, grid2 = process_image(np.asarray(img, dtype=np.float32) / 255.0, CFG)
    assert torch.equal(grid, grid2)
    torch.testing.assert_close(from_png, from_array, rtol=0, atol=1e-6)

    big = _gradient(300, 500)  # resized: 8-bit and float resampling differ by rounding only
    a, grid = process_image(big, CFG)
    b, grid2 = process_image(np.asarray(big, dtype=np.float32) / 255.0, CFG)
    assert torch.equal(grid, grid2)
    assert (a - b).abs().max() <= 2 * (1 / 255)  # one 8-bit level, at the normalised 2x scale


def test_other_image_modes_become_rgb() -> None:
    for mode in ("L", "RGBA", "P", "CMYK"):
        img = _gradient(60, 70).convert(mode)
        fmt = "JPEG" if mode in ("L", "CMYK") else "PNG"
        decoded = decode_image(_encode(img, fmt), CFG)
        assert decoded.mode == "RGB" and decoded.size == (70, 60)
        pixel_values, grid = process_image(decoded, CFG)
        h, w = grid[0, 1:].tolist()
        assert h % 2 == 0 and w % 2 == 0 and pixel_values.shape == (h * w, 588)


def test_jpeg_round_trip_size() -> None:
    decoded = decode_image(_encode(_gradient(100, 200), "JPEG"), CFG)
    assert decoded.size == (200, 100)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"GIF89a" + b"\0" * 20, "IMAGE_FORMAT"),
        (b"not an image at all", "IMAGE_FORMAT"),
        (b"", "IMAGE_FORMAT"),
        (_encode(_noise(64, 64), "PNG")[:2000], "IMAGE_CORRUPT"),
        (_encode(_noise(64, 64), "JPEG")[:2000], "IMAGE_CORRUPT"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "IMAGE_CORRUPT"),
        (_with_header_size(_encode(_gradient(8, 8), "PNG"), 60_000, 60_000), "IMAGE_TOO_LARGE"),
    ],
)
def test_bad_files_are_invalid_input(data: bytes, reason: str) -> None:
    with pytest.raises(InvalidInput) as info:
        decode_image(data, CFG)
    assert info.value.reason == reason
    assert isinstance(info.value, ValueError)


def test_size_limits() -> None:
    png = _encode(_gradient(40, 40), "PNG")
    with pytest.raises(InvalidInput, match="bytes; the limit is 100"):
        decode_image(png, ImageProcessorConfig(max_image_bytes=100))
    with pytest.raises(InvalidInput, match="40x40 pixels; the limit is 1000"):
        decode_image(png, ImageProcessorConfig(max_image_pixels=1000))
    with pytest.raises(InvalidInput, match="limit is 999"):
        process_image(np.zeros((40, 40, 3), np.float32), ImageProcessorConfig(max_image_pixels=999))


@pytest.mark.parametrize(
    ("pixels", "match"),
    [
        (np.zeros((28, 28, 3), np.uint8), "float16, float32 or float64"),
        (np.zeros((28, 28, 4), np.float32), r"\(height, width, 3\)"),
        (np.zeros((28, 28), np.float32), r"\(height, width, 3\)"),
        (np.zeros((0, 28, 3), np.float32), "empty"),
        (np.full((28, 28, 3), 1.5, np.float32), r"in \[0, 1\]"),
        (np.full((28, 28, 3), np.nan, np.float32), "finite"),
        (np.zeros((1, 300, 3), np.float32), "aspect ratio"),
    ],
)
def test_raw_pixel_validation(pixels: np.ndarray, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        process_image(pixels, CFG)


def test_float16_and_float64_pixels_are_accepted() -> None:
    for dtype in (np.float16, np.float64):
        pixel_values, _ = process_image(np.full((30, 30, 3), 0.25, dtype), CFG)
        assert pixel_values.dtype == torch.float32
        torch.testing.assert_close(pixel_values, torch.full_like(pixel_values, -0.5))


def test_smart_resize_examples() -> None:
    assert smart_resize(224, 224, CFG) == (224, 224)
    assert smart_resize(1000, 1000, CFG) == (448, 448)
    assert smart_resize(10, 10, CFG) == (56, 56)
    assert smart_resize(100, 200, CFG) == (112, 196)
    with pytest.raises(InvalidInput, match="aspect ratio"):
        smart_resize(10, 2010, CFG)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 6000),
    st.integers(1, 6000),
    st.sampled_from([CFG, ImageProcessorConfig(min_pixels=28 * 28, max_pixels=28 * 28 * 4)]),
)
def test_smart_resize_properties(height: int, width: int, cfg: ImageProcessorConfig) -> None:
    if max(height, width) / min(height, width) > 200:
        return
    h, w = smart_resize(height, width, cfg)
    assert h % cfg.factor == 0 and w % cfg.factor == 0 and h > 0 and w > 0
    assert h * w <= cfg.max_pixels
    if cfg is CFG:
        assert h * w >= cfg.min_pixels
        # The aspect ratio is kept up to rounding to whole merged patches.
        assert abs(h / w - height / width) <= (height / width) * (cfg.factor / min(h, w)) + 0.5


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="min_pixels"):
        ImageProcessorConfig(min_pixels=100)
    with pytest.raises(ValueError, match="min_pixels"):
        ImageProcessorConfig(min_pixels=10_000, max_pixels=5_000)
    with pytest.raises(ValueError, match="std"):
        ImageProcessorConfig(std=(0.5, 0.0, 0.5))


def test_mm_hash_covers_content_settings_and_salt() -> None:
    png = _encode(_gradient(30, 30), "PNG")
    base = mm_hash(png, CFG, "")
    assert base == mm_hash(png, ImageProcessorConfig(), "")
    assert len(base) == 64 and int(base, 16) >= 0
    others = {
        mm_hash(png + b"\0", CFG, ""),
        mm_hash(png, CFG, "tenant"),
        mm_hash(png, ImageProcessorConfig(max_pixels=224 * 224), ""),
        mm_hash(png, ImageProcessorConfig(mean=(0.4, 0.5, 0.5)), ""),
        mm_hash_from_uuid("photo-1", "", (28, 28)),
    }
    assert base not in others and len(others) == 5
    # Limits do not change the output, so they do not change the key.
    assert mm_hash(png, ImageProcessorConfig(max_image_bytes=10**6), "") == base


def test_mm_hash_of_arrays_includes_shape_and_dtype() -> None:
    flat = np.linspace(0, 1, 36, dtype=np.float32)
    a = mm_hash(flat.reshape(2, 6, 3), CFG, "")
    assert a == mm_hash(flat.reshape(2, 6, 3).copy(), CFG, "")
    assert a != mm_hash(flat.reshape(6, 2, 3), CFG, "")
    assert a != mm_hash(flat.reshape(2, 6, 3).astype(np.float64), CFG, "")
    assert a != mm_hash(flat.reshape(2, 6, 3).tobytes(), CFG, "")
    transposed = flat.reshape(6, 2, 3).transpose(1, 0, 2)  # not C-contiguous
    assert mm_hash(transposed, CFG, "") == mm_hash(np.ascontiguousarray(transposed), CFG, "")


def test_uuid_hash_depends_on_uuid_salt_and_size_only() -> None:
    g = (56, 84)
    assert mm_hash_from_uuid("u", "", g) == mm_hash_from_uuid("u", "", g)
    assert mm_hash_from_uuid("u", "", g) != mm_hash_from_uuid("u", "s", g)
    assert mm_hash_from_uuid("u", "s", g) != mm_hash_from_uuid("us", "", g)
    assert mm_hash_from_uuid("u", "", g) != mm_hash_from_uuid("u", "", (84, 56))


# --- Hugging Face checkpoints: preprocessor_config.json and transformers as reference ---

_SWEEP = [  # (height, width): tiny, square, odd, both extreme aspect ratios, huge
    (1, 1), (3, 5), (28, 28), (56, 84), (100, 200), (333, 517), (10, 1000), (1000, 10),
    (10, 1999), (1999, 10), (1, 150), (15, 2990), (2000, 1500), (3000, 4000),
]


def _qwen_dir(tmp_path, **overrides) -> tuple[object, ImageProcessorConfig]:
    """A preprocessor_config.json saved by transformers, its reference and Tandem's config."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    ref = Qwen2VLImageProcessorPil(**overrides)
    ref.save_pretrained(tmp_path)
    return ref, ImageProcessorConfig.from_pretrained_dir(tmp_path)


def _image_for(height: int, width: int) -> Image.Image:
    # Noise where the PNG stays small; a gradient for the huge ones (under the byte limit).
    return _noise(height, width) if height * width <= 1_000_000 else _gradient(height, width)


def _assert_same_as_reference(ref, cfg: ImageProcessorConfig, png: bytes) -> None:
    pixel_values, grid = process_image(decode_image(png, cfg), cfg)
    expected = ref(images=[Image.open(io.BytesIO(png))], return_tensors="np")
    assert grid.tolist() == expected["image_grid_thw"].tolist()
    assert pixel_values.dtype == torch.float32
    assert np.array_equal(pixel_values.numpy(), expected["pixel_values"])  # bit-identical


@pytest.mark.parametrize(("height", "width"), _SWEEP)
def test_qwen2_vl_pixels_and_grid_are_bit_identical_to_transformers(tmp_path, height, width):
    ref, cfg = _qwen_dir(tmp_path)
    _assert_same_as_reference(ref, cfg, _encode(_image_for(height, width), "PNG"))


def test_qwen2_vl_rows_are_c_t_p_p_in_merge_windows(tmp_path) -> None:
    _, cfg = _qwen_dir(tmp_path)
    pixels = np.random.default_rng(2).random((56, 84, 3), dtype=np.float32)  # no resize
    pixel_values, grid = process_image(pixels, cfg)
    p, m = cfg.patch_size, cfg.merge_size
    assert grid.tolist() == [[1, 4, 6]] and pixel_values.shape == (24, 3 * 2 * p * p)
    mean, std = np.array(cfg.mean, np.float32), np.array(cfg.std, np.float32)
    row = 0
    for wi in range(2):  # merge windows in raster order, their 2x2 patches consecutive
        for wj in range(3):
            for i in range(m):
                for j in range(m):
                    y, x = (wi * m + i) * p, (wj * m + j) * p
                    patch = ((pixels[y:y + p, x:x + p] - mean) / std).transpose(2, 0, 1)
                    frames = np.stack([patch, patch], axis=1)  # (C, T, P, P): still frame twice
                    np.testing.assert_allclose(pixel_values[row].numpy(), frames.reshape(-1),
                                               rtol=1e-6)
                    row += 1


def test_transparency_is_composited_on_white_like_transformers(tmp_path) -> None:
    ref, cfg = _qwen_dir(tmp_path)
    rgba = np.random.default_rng(3).integers(0, 256, (60, 90, 4), dtype=np.uint8)
    _assert_same_as_reference(ref, cfg, _encode(Image.fromarray(rgba, "RGBA"), "PNG"))
    # The built-in presets still drop the alpha channel, as before.
    plain = decode_image(_encode(Image.fromarray(rgba, "RGBA"), "PNG"), CFG)
    assert np.array_equal(np.asarray(plain), rgba[:, :, :3])


def test_preprocessor_settings_are_read_like_transformers(tmp_path) -> None:
    ref, cfg = _qwen_dir(tmp_path, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64,
                         image_mean=[0.1, 0.2, 0.3], image_std=[0.9, 0.8, 0.7],
                         resample=Image.Resampling.BILINEAR, do_normalize=False)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.resample) == (3136, 50176, 2)
    for size in ((500, 300), (20, 20), (30, 900)):
        _assert_same_as_reference(ref, cfg, _encode(_noise(*size), "PNG"))


def test_older_min_max_pixels_form(tmp_path) -> None:
    """Qwen2-VL's original file: top-level min_pixels/max_pixels, no size."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
    }))
    cfg = ImageProcessorConfig.from_pretrained_dir(tmp_path)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.temporal_patch_size) == (3136, 12845056, 2)
    assert cfg.patch_order == "merge_window" and cfg.alpha_background == (255, 255, 255)


def test_extreme_aspect_ratio_grid_matches_reference_rule() -> None:
    """10x1000 rounds its short side to 0 first, so it is scaled up: 28x560 (grid 2x40)."""
    assert smart_resize(10, 1000, CFG) == (28, 560)
    assert smart_resize(1000, 10, CFG) == (560, 28)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "preprocessor_config.json: file missing"),
        ("{not json", "not valid JSON"),
        ('{"image_processor_type": "CLIPImageProcessor"}', "image_processor_type is 'CLIP"),
        ('{"image_processor_type": "Qwen2VLImageProcessor", "patch_size": "14"}',
         "patch_size must be int"),
        ('{"image_processor_type": "Qwen2VLImageProcessor", "image_mean": [0.5]}',
         "image_mean must be 3 numbers"),
        ('{"image_processor_type": "Qwen2VLImageProcessor", "do_resize": false}',
         "do_resize must be true"),
        ('{"image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": 10}}',
         "min_pixels"),
        ('{"image_processor_type": "Qwen2VLImageProcessor", "resample": 42}', "resample"),
    ],
)
def test_bad_preprocessor_config_names_file_and_key(tmp_path, content, match) -> None:
    if content is not None:
        (tmp_path / "preprocessor_config.json").write_text(content)
    with pytest.raises(InvalidInput, match=match) as info:
        ImageProcessorConfig.from_pretrained_dir(tmp_path)
    assert str(tmp_path / "preprocessor_config.json") in info.value.message
