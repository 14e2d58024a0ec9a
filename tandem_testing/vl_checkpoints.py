"""Servable tiny random Qwen2-VL directories: the real Qwen tokenizer and chat template
(``text_checkpoints.py``) next to a transformers model's weights and an image processor's
config. A module of its own: ``text_checkpoints`` reads SmolLM2's files from
``hf_models``, and these directories need ``text_checkpoints``' tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tandem_testing.hf_models import CACHE
from tandem_testing.text_checkpoints import qwen2_vl_dir  # builds the Qwen vocabulary

# Qwen2's vocabulary size and its vision tokens' real ids (tandem_testing/text_checkpoints.py
# has the tokenizer that puts them there).
QWEN_VOCAB = 151936
QWEN_VL_IDS = dict(image_token_id=151655, vision_start_token_id=151652,
                   vision_end_token_id=151653, video_token_id=151656)
# A 112x84 image is 48 patches, 12 image tokens; a large one is cut down to 48 tokens.
VL_PIXELS = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 48)


def vl_model_dir(model, out: Path) -> Path:  # model: a transformers Qwen2-VL-style model
    """A servable directory for the random Qwen2-VL-style ``model`` (whose config gets
    Qwen's vision token ids, so transformers' ``generate`` on it is the reference): its
    weights, the real Qwen tokenizer and chat template, a generation config and the image
    processor's ``preprocessor_config.json``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    for key, value in QWEN_VL_IDS.items():
        setattr(model.config, key, value)
    model.save_pretrained(out)
    tokenizer = qwen2_vl_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, out / name)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "eos_token_id": [151645, 151643]}))
    Qwen2VLImageProcessorPil(**VL_PIXELS).save_pretrained(out)
    return out


def qwen2_vl_64_dir() -> Path:
    """A tiny random Qwen2-VL whose decoder and vision tower both have head size 64 (vLLM's
    CPU attention has no kernel for smaller heads, e.g. the tests' 16): 2 decoder layers of
    width 128, 2 vision blocks of width 128, the real vocabulary (untied, float32, ~160 MB).
    Built once (seconds) and cached under ``.cache/``; the name carries a version, bumped
    when the recipe changes."""
    out = CACHE / "qwen2-vl-64-random-v1"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    import transformers

    cfg = transformers.Qwen2VLConfig(
        text_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=QWEN_VOCAB,
                         max_position_embeddings=4096, bos_token_id=151643,
                         eos_token_id=151645, rms_norm_eps=1e-6,
                         # head size 64: 32 frequency pairs over time, height, width
                         rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}),
        vision_config=dict(depth=2, embed_dim=128, hidden_size=128, num_heads=2, mlp_ratio=2),
        tie_word_embeddings=False, **QWEN_VL_IDS)
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(cfg).eval()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    vl_model_dir(model, tmp)
    tmp.rename(out)
    return out
