"""Hugging Face ``config.json`` (+ ``generation_config.json``) -> ``ModelConfig`` fields.

Two layouts are found in the wild and both are read: the older flat one (decoder keys at
the top, ``rope_scaling: {type: mrope, mrope_section}``, ``vision_config`` nested) and the
current nested one (``text_config`` + ``vision_config``, ``rope_parameters``; what
transformers 5.x ``save_pretrained`` writes). A decoder key is looked up in ``text_config``
first, then at the top; vision keys in ``vision_config``. Keys a checkpoint may omit take
transformers' defaults for that architecture (the reference reads them the same way).

Every refusal names the file and the key. Returns plain fields (no ``ModelConfig``), so
``model_config.py`` can call this without an import cycle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.checkpoint_ids import QWEN_VL_TYPES, checkpoint_ids
from tandem.errors import InvalidInput

GENERATION_CONFIG_FILE = "generation_config.json"
DECODERS = ("llama", "qwen2")  # text only, plain RoPE
VLMS = QWEN_VL_TYPES  # M-RoPE decoder + vision tower
VISION_ACTS = ("quick_gelu", "silu", "gelu")
_DEFAULT_MROPE = [16, 24, 24]


class _Keys:
    """Lookups in one config.json that name the file and the key when they fail."""

    def __init__(self, path: Path, raw: dict[str, Any], section: str,
                 fallback: bool = True) -> None:
        """Keys of ``raw[section]``, then (with ``fallback``) of ``raw`` itself."""
        self.path, self.section = path, section
        nested = raw.get(section)
        self.inner: dict[str, Any] = nested if isinstance(nested, dict) else {}
        self.raw = raw if fallback else {}

    def name(self, key: str) -> str:
        return f"{self.section}.{key}" if key in self.inner else key

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.inner:
            return self.inner[key]
        return self.raw.get(key, default)

    def need(self, key: str, kind: type = int) -> Any:
        value = self.get(key)
        if value is None or not isinstance(value, kind) or isinstance(value, bool):
            self.fail(key, f"must be {'an integer' if kind is int else kind.__name__}")
        return value

    def fail(self, key: str, why: str) -> None:
        raise InvalidInput(f"{self.path}: key {self.name(key)!r} {why}", reason="BAD_CHECKPOINT")


def hf_config_fields(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments for the checkpoint whose config.json is ``path``."""
    model_type = raw.get("model_type")
    if model_type not in DECODERS + VLMS:
        raise InvalidInput(
            f"{path}: key 'model_type' is {model_type!r}; Tandem serves "
            f"{', '.join(DECODERS + VLMS)}", reason="UNKNOWN_MODEL")
    text = _Keys(path, raw, "text_config")
    fields = _decoder_fields(text, model_type)
    fields.update(_special_ids(path, raw))
    if model_type in VLMS:
        vision = _Keys(path, raw, "vision_config", fallback=False)
        fields.update(_vision_fields(vision, model_type, fields["dim"]))
    return fields


def _decoder_fields(text: _Keys, model_type: str) -> dict[str, Any]:
    if text.get("hidden_act", "silu") != "silu":
        text.fail("hidden_act", f"is {text.get('hidden_act')!r}; only silu is supported")
    if text.get("use_sliding_window", False):
        text.fail("use_sliding_window", "is true; sliding-window attention is not supported")
    heads = text.need("num_attention_heads")
    dim = text.need("hidden_size")
    head_dim = text.get("head_dim")
    qwen = model_type != "llama"  # the Qwen2 family: q/k/v biased, o_proj not
    attention_bias = bool(text.get("attention_bias", False))
    fields: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": text.need("vocab_size"),
        "dim": dim,
        "n_layers": text.need("num_hidden_layers"),
        "n_heads": heads,
        "n_kv_heads": text.get("num_key_value_heads") or heads,
        "explicit_head_dim": head_dim if head_dim and head_dim != dim // heads else None,
        "intermediate_size": text.need("intermediate_size"),
        "norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "max_seq_len": text.need("max_position_embeddings"),
        "qkv_bias": qwen or attention_bias,
        "out_bias": not qwen and attention_bias,
        "mlp_bias": bool(text.get("mlp_bias", False)),
        # The top-level flag is the one the whole model obeys (nested configs may repeat it).
        "tie_word_embeddings": bool(text.raw.get("tie_word_embeddings",
                                                 text.get("tie_word_embeddings", False))),
    }
    head = head_dim or dim // heads
    fields.update(_rope_fields(text, model_type, head))
    return fields


def _rope_fields(text: _Keys, model_type: str, head_dim: int) -> dict[str, Any]:
    key = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
    rope = text.get(key) or {}
    if not isinstance(rope, dict):
        text.fail(key, "must be an object")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope", "llama3"):
        text.fail(key, f"has rope type {kind!r}; supported: default, mrope, llama3")
    theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    llama3 = None
    if kind == "llama3":
        names = ("factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings")
        if not all(isinstance(rope.get(n), int | float) for n in names) or (
                rope["high_freq_factor"] <= rope["low_freq_factor"]):
            text.fail(key, f"llama3 scaling needs numbers {', '.join(names)} "
                           "(high_freq_factor > low_freq_factor)")
        llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]),
                  float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    if model_type in VLMS:
        section = rope.get("mrope_section", _DEFAULT_MROPE)
        if not isinstance(section, list) or len(section) != 3 or sum(section) != head_dim // 2:
            text.fail(key, f"mrope_section {section} must be 3 sizes summing to head_dim/2 "
                           f"= {head_dim // 2}")
        if llama3 is not None:
            text.fail(key, "combines llama3 scaling with M-RoPE")
        return {"rope_theta": theta, "position_scheme": "mrope",
                "mrope_section": tuple(section)}
    # Plain RoPE: the three position components are equal, so any split is the same.
    return {"rope_theta": theta, "rope_llama3": llama3, "position_scheme": "rope",
            "mrope_section": (head_dim // 2, 0, 0)}


def _special_ids(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """The ids as the scheduler's tokenizer reads them too (tandem.checkpoint_ids)."""
    gen_path = path.parent / GENERATION_CONFIG_FILE
    gen = None
    if gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidInput(f"{gen_path}: not readable JSON ({exc})",
                               reason="BAD_CHECKPOINT") from exc
        if not isinstance(gen, dict):
            raise InvalidInput(f"{gen_path}: not a JSON object", reason="BAD_CHECKPOINT")
    ids = checkpoint_ids(raw, path, gen, gen_path)
    return {"bos_token_id": ids.bos, "eos_token_ids": ids.eos, "pad_token_id": ids.pad,
            "image_token_id": ids.image, "vision_start_token_id": ids.vision_start,
            "vision_end_token_id": ids.vision_end}


def _vision_fields(v: _Keys, model_type: str, text_dim: int) -> dict[str, Any]:
    """The vision tower; its merger must project to the decoder width."""
    qwen2 = model_type == "qwen2_vl"
    width = v.get("embed_dim", 1280) if qwen2 else v.get("hidden_size", 3584)
    out_key = "hidden_size" if qwen2 else "out_hidden_size"
    if v.get(out_key, 3584) != text_dim:
        v.fail(out_key, f"is {v.get(out_key, 3584)}, not the decoder's hidden_size {text_dim}")
    act = v.get("hidden_act", "quick_gelu" if qwen2 else "silu")
    if act not in VISION_ACTS:
        v.fail("hidden_act", f"is {act!r}; supported: {', '.join(VISION_ACTS)}")
    heads = v.get("num_heads", 16)
    fields: dict[str, Any] = {
        "vision_dim": width,
        "vision_layers": v.get("depth", 32),
        "vision_heads": heads,
        "vision_intermediate_size": (int(width * v.get("mlp_ratio", 4)) if qwen2
                                     else v.get("intermediate_size", 3420)),
        "vision_act": act,
        "patch_size": v.get("patch_size", 14),
        "in_channels": v.get("in_channels", v.get("in_chans", 3)),
        "temporal_patch_size": v.get("temporal_patch_size", 2),
        "merge_size": v.get("spatial_merge_size", 2),
        # Sides up to 4096 patches: the processor's default max_pixels at its 200:1 aspect
        # limit stays below that (the table is 4096 x head_dim/4 cos/sin pairs, ~1 MB).
        "vision_max_grid": 4096,
    }
    if width % heads or (width // heads) % 4:
        v.fail("num_heads", f"{heads} must split the width {width} into heads of a multiple of 4")
    if not qwen2:
        fields["vision_window_size"] = v.get("window_size", 112)
        fields["vision_full_attention_blocks"] = tuple(
            v.get("fullatt_block_indexes", [7, 15, 23, 31]))
    return fields
