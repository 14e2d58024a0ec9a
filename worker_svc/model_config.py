"""Config of the built-in vision-language model, its presets, and how a name selects one.

The scheduler learns the config from the workers (``Describe`` sends ``to_json()``: patch
and merge sizes, ``position_scheme``, ``max_seq_len``); this module does not import torch,
so tools can read configs cheaply.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from tandem.errors import InvalidInput
from tandem.tokenizer import VOCAB_SIZE

PositionScheme = Literal["rope", "mrope"]
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes of the decoder and the vision tower; derived sizes are properties."""

    vocab_size: int = VOCAB_SIZE  # 256 bytes + PAD, BOS, EOS, IMAGE
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: n_heads // n_kv_heads queries per KV head
    intermediate_size: int = 352  # SwiGLU hidden width, ~2.75 x dim
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096  # rotary table length; positions never exceed the token index
    position_scheme: PositionScheme = "rope"
    # Rotary frequency pairs driven by the (t, h, w) position components under M-RoPE;
    # sums to head_dim // 2. Under plain RoPE the three components are equal, so the
    # split makes no difference and M-RoPE of text degenerates to RoPE.
    mrope_section: tuple[int, int, int] = (4, 6, 6)
    patch_size: int = 14
    in_channels: int = 3
    merge_size: int = 2  # 2x2 neighbouring patches become one LM embedding
    vision_dim: int = 64
    vision_layers: int = 2
    vision_heads: int = 4
    vision_intermediate_size: int = 256
    vision_max_grid: int = 512  # patches per side the vision rotary table covers
    seed: int = 1234  # of the deterministic weight init

    def __post_init__(self) -> None:
        assert self.dim % self.n_heads == 0, "dim must be a multiple of n_heads"
        assert self.n_heads % self.n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads"
        assert sum(self.mrope_section) == self.head_dim // 2, (
            f"mrope_section {self.mrope_section} must sum to head_dim/2 = {self.head_dim // 2}"
        )
        assert self.vision_head_dim % 4 == 0, "vision head_dim must split into row/col pairs"
        assert self.position_scheme in ("rope", "mrope"), self.position_scheme

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def vision_head_dim(self) -> int:
        return self.vision_dim // self.vision_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened (C, P, P) patch: a row of ``pixel_values``."""
        return self.in_channels * self.patch_size**2

    @property
    def uses_mrope(self) -> bool:
        return self.position_scheme == "mrope"

    def kv_bytes_per_block(self, block_size: int, element_size: int) -> int:
        """Keys and values of ``block_size`` tokens over all layers."""
        return 2 * self.n_layers * block_size * self.n_kv_heads * self.head_dim * element_size

    def num_image_tokens(self, grid_h: int, grid_w: int) -> int:
        """LM embeddings (= placeholder tokens) for an image of ``grid_h x grid_w`` patches."""
        return (grid_h // self.merge_size) * (grid_w // self.merge_size)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        raw: dict[str, Any] = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidInput(f"unknown model config keys {unknown}")
        if "mrope_section" in raw:
            raw["mrope_section"] = tuple(raw["mrope_section"])
        return cls(**raw)


_TINY = ModelConfig()
_SMALL = ModelConfig(
    dim=512, n_layers=8, n_heads=8, n_kv_heads=4, intermediate_size=1408,
    mrope_section=(8, 12, 12), vision_dim=256, vision_layers=4, vision_heads=4,
    vision_intermediate_size=1024,
)
PRESETS: dict[str, ModelConfig] = {
    "tiny": _TINY,
    "tiny-mrope": replace(_TINY, position_scheme="mrope"),
    "small": _SMALL,
    "small-mrope": replace(_SMALL, position_scheme="mrope"),
}


def model_config_from_name(name_or_path: str) -> ModelConfig:
    """A preset by exact name, or the ``config.json`` of a model directory."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path) / CONFIG_FILE
    if not path.is_file():
        raise InvalidInput(
            f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a "
            f"directory holding {CONFIG_FILE}", reason="UNKNOWN_MODEL")
    return ModelConfig.from_json(path.read_text())
