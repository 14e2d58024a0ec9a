"""Config of the decoder and its vision tower, the built-in presets, and how a name selects one.

One ``ModelConfig`` describes the built-in model (``model_type`` "tandem") and the Hugging
Face architectures Tandem serves (``hf_config.py`` reads their ``config.json``). The
scheduler learns the config from the workers: ``Describe`` sends ``to_json()``, whose keys
are the field names below (docs/models.md lists the ones the scheduler relies on: patch,
merge and temporal sizes, ``position_scheme``, ``max_seq_len``, ``model_type`` and the
special token ids). This module does not import torch, so tools can read configs cheaply.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from tandem.errors import InvalidInput
from tandem.text.byte_tokenizer import BOS_ID, EOS_ID, IMAGE_ID, PAD_ID, VOCAB_SIZE
from worker_svc.hf_config import hf_config_fields

PositionScheme = Literal["rope", "mrope"]
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TANDEM = "tandem"  # model_type of the built-in model and of export_model's files
VISION_TYPES = (TANDEM, "qwen2_vl", "qwen2_5_vl")  # model types with a vision tower
_TUPLE_FIELDS = ("mrope_section", "eos_token_ids", "vision_full_attention_blocks", "rope_llama3")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes of the decoder and the vision tower; derived sizes are properties.

    The defaults are the built-in ``tiny`` model; the fields after ``seed`` (biases, tied
    embeddings, special ids...) were added for Hugging Face checkpoints, and their defaults
    keep the built-in models and their exported files as they were.
    """

    model_type: str = TANDEM  # "tandem", or the checkpoint's model_type (hf_config.py)
    vocab_size: int = VOCAB_SIZE  # 256 bytes + PAD, BOS, EOS, IMAGE
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: n_heads // n_kv_heads queries per KV head
    explicit_head_dim: int | None = None  # config.json head_dim; None: dim // n_heads
    intermediate_size: int = 352  # SwiGLU hidden width, ~2.75 x dim
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1 frequency rescaling: (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); None = plain RoPE frequencies.
    rope_llama3: tuple[float, float, float, int] | None = None
    max_seq_len: int = 4096  # rotary table length; positions never exceed the token index
    position_scheme: PositionScheme = "rope"
    # Rotary frequency pairs driven by the (t, h, w) position components under M-RoPE;
    # sums to head_dim // 2. Under plain RoPE the three components are equal, so the
    # split makes no difference and M-RoPE of text degenerates to RoPE.
    mrope_section: tuple[int, int, int] = (4, 6, 6)
    patch_size: int = 14
    in_channels: int = 3
    temporal_patch_size: int = 1  # frames per patch (Qwen2-VL: 2, a still image repeated)
    merge_size: int = 2  # 2x2 neighbouring patches become one LM embedding
    vision_dim: int = 64
    vision_layers: int = 2
    vision_heads: int = 4
    vision_intermediate_size: int = 256
    vision_max_grid: int = 512  # patches per side the vision rotary table covers
    seed: int = 1234  # of the deterministic weight init
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    out_bias: bool = False  # bias on the attention output projection (Llama attention_bias)
    mlp_bias: bool = False  # biases on the SwiGLU projections (Llama mlp_bias)
    tie_word_embeddings: bool = False  # the output head is the token embedding matrix
    vision_act: str = "gelu"  # activation of the vision MLP (quick_gelu, silu, gelu)
    # Qwen2.5-VL window attention: window side in pixels (0 = every block attends over the
    # whole image) and the blocks that attend over the whole image anyway.
    vision_window_size: int = 0
    vision_full_attention_blocks: tuple[int, ...] = ()
    # Special token ids (None: the model has none). The byte tokenizer's for the built-in
    # models; for a checkpoint, config.json's, and generation_config.json's end ids.
    bos_token_id: int | None = BOS_ID
    eos_token_ids: tuple[int, ...] = (EOS_ID,)
    pad_token_id: int | None = PAD_ID
    image_token_id: int | None = IMAGE_ID  # placeholder of one image embedding; None: text only
    vision_start_token_id: int | None = None  # text tokens around a placeholder run
    vision_end_token_id: int | None = None

    def __post_init__(self) -> None:
        # Real errors, not asserts: a checkpoint's config.json reaches this constructor.
        checks = [
            (self.explicit_head_dim is not None or self.dim % self.n_heads == 0,
             f"dim {self.dim} must be a multiple of n_heads {self.n_heads}"),
            (self.n_heads % self.n_kv_heads == 0,
             f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}"),
            (sum(self.mrope_section) == self.head_dim // 2,
             f"mrope_section {self.mrope_section} must sum to head_dim/2 = "
             f"{self.head_dim // 2}"),
            (not self.has_vision or self.vision_head_dim % 4 == 0,
             "vision head_dim must split into row/col pairs"),
            (self.position_scheme in ("rope", "mrope"), f"position_scheme {self.position_scheme}"),
        ]
        bad = [message for ok, message in checks if not ok]
        if bad:
            raise InvalidInput(f"model config: {'; '.join(bad)}", reason="BAD_MODEL_CONFIG")

    @property
    def head_dim(self) -> int:
        if self.explicit_head_dim is not None:
            return self.explicit_head_dim
        return self.dim // self.n_heads

    @property
    def has_vision(self) -> bool:
        return self.model_type in VISION_TYPES

    @property
    def vision_head_dim(self) -> int:
        return self.vision_dim // self.vision_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened (C, T, P, P) patch: a row of ``pixel_values``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

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
        for key in _TUPLE_FIELDS:
            if raw.get(key) is not None:
                raw[key] = tuple(raw[key])
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
    """A preset by exact name, or the ``config.json`` of a model directory: Tandem's own
    (written by ``export_model``: no ``model_type``, or "tandem") or a Hugging Face one."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path) / CONFIG_FILE
    if not path.is_file():
        where = (f"directory {name_or_path!r} has no {CONFIG_FILE}" if Path(name_or_path).is_dir()
                 else f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor "
                      f"a directory holding {CONFIG_FILE}")
        raise InvalidInput(where, reason="UNKNOWN_MODEL")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInput(f"{path}: not readable JSON ({exc})", reason="BAD_CHECKPOINT") from exc
    if not isinstance(raw, dict):
        raise InvalidInput(f"{path}: not a JSON object", reason="BAD_CHECKPOINT")
    if raw.get("model_type", TANDEM) == TANDEM:
        return ModelConfig.from_json(json.dumps(raw))
    try:
        return ModelConfig(**hf_config_fields(path, raw))
    except InvalidInput as exc:
        if exc.reason != "BAD_MODEL_CONFIG":
            raise
        raise InvalidInput(f"{path}: {exc.message}", reason="BAD_CHECKPOINT") from exc
