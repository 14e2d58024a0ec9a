"""The special token ids a Hugging Face checkpoint's config files name, read in one place.

The scheduler's tokenizer (``tandem.text.hf_tokenizer``) and the workers' model config
(``worker_svc.hf_config``) both need them and must agree: the scheduler stops on the EOS ids
that the workers keep from being sampled under ``min_tokens``, and it refuses to serve when
its image placeholder id is not the model's. Callers read the files (each with its own
errors for unreadable JSON) and pass their objects here.

A decoder key is looked up in ``text_config`` first, then at the top (both layouts are
found in the wild). EOS ids come from ``generation_config.json`` (what ``generate`` stops
on; an int or a list), else ``config.json``. Qwen2-VL configs may omit their vision ids;
they then take transformers' defaults for that architecture.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.errors import InvalidInput

QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")
# transformers' defaults where Qwen2-VL configs omit a key (facts of its config classes).
_QWEN_VL_IDS = {"image_token_id": 151655, "vision_start_token_id": 151652,
                "vision_end_token_id": 151653}


@dataclass(frozen=True)
class CheckpointIds:
    bos: int | None  # config.json bos_token_id
    eos: tuple[int, ...]  # empty: the config files name none
    pad: int | None  # config.json pad_token_id
    image: int | None  # the placeholder of one image embedding; None: text only
    vision_start: int | None  # the text tokens around a placeholder run
    vision_end: int | None


def checkpoint_ids(config: Mapping[str, Any], config_path: Path,
                   generation: Mapping[str, Any] | None, generation_path: Path,
                   ) -> CheckpointIds:
    """The ids of ``config.json`` (``config``) and ``generation_config.json`` (``generation``,
    None when absent). A malformed id is InvalidInput naming the file and the key."""
    eos = id_list(generation or {}, "eos_token_id", generation_path) or id_list(
        _text(config, "eos_token_id"), "eos_token_id", config_path)
    vision: dict[str, int | None] = {key: _id(_text(config, key), key, config_path)
                                     for key in _QWEN_VL_IDS}
    if config.get("model_type") in QWEN_VL_TYPES:
        vision = {k: v if v is not None else _QWEN_VL_IDS[k] for k, v in vision.items()}
    return CheckpointIds(
        bos=_id(_text(config, "bos_token_id"), "bos_token_id", config_path),
        eos=eos,
        pad=_id(_text(config, "pad_token_id"), "pad_token_id", config_path),
        image=vision["image_token_id"], vision_start=vision["vision_start_token_id"],
        vision_end=vision["vision_end_token_id"])


def _text(config: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """The part of config.json that holds ``key``: ``text_config`` if it has it, else the top."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) and key in nested else config


def id_list(source: Mapping[str, Any], key: str, path: Path) -> tuple[int, ...]:
    """``source[key]``: an id or a list of ids (none: empty), else InvalidInput."""
    value = source.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise InvalidInput(f"{path}: {key} must be an integer or a list of integers, got "
                           f"{value!r}", "BAD_MODEL")
    return tuple(values)


def _id(source: Mapping[str, Any], key: str, path: Path) -> int | None:
    value = source.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise InvalidInput(f"{path}: {key} must be an integer, got {value!r}", "BAD_MODEL")
    return value
