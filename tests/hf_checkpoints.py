"""Tiny random Hugging Face checkpoints, built offline by transformers (the test reference).

``reference(kind)`` is a transformers model with variance-preserving random weights and
non-zero biases everywhere (transformers' own init zeroes the biases and uses std 0.02,
which makes greedy output repeat one token and would hide a missing bias), and ``save``
writes it with ``save_pretrained``. Images go through transformers'
``Qwen2VLImageProcessor``; prompts lay out ``<|vision_start|>`` + ``<|image_pad|>`` x N +
``<|vision_end|>`` per image as Qwen2-VL's chat template does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from transformers import Qwen2VLImageProcessor

from tandem.features import FieldElem, MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from tandem_testing.hf_models import smollm2_dir as smollm2_dir  # one copy, shared with bench/
from worker_svc.request_state import IMAGE_GRID_THW, PIXEL_VALUES

transformers.logging.set_verbosity_error()  # no warnings about the tiny vocabulary

VOCAB = 300
IMAGE_PAD, VISION_START, VISION_END, VIDEO_PAD = 290, 291, 292, 293
BOS, EOS = 1, 2
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096,
            bos_token_id=BOS, eos_token_id=EOS, rms_norm_eps=1e-6)
VL_IDS = dict(image_token_id=IMAGE_PAD, vision_start_token_id=VISION_START,
              vision_end_token_id=VISION_END, video_token_id=VIDEO_PAD)
MROPE = {"type": "mrope", "mrope_section": [2, 3, 3]}  # head_dim 16: 8 frequency pairs


def config(kind: str, tied: bool = False) -> transformers.PretrainedConfig:
    if kind == "qwen2_vl":
        return transformers.Qwen2VLConfig(
            text_config=dict(TEXT, rope_scaling=MROPE), tie_word_embeddings=tied,
            vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2,
                               mlp_ratio=2), **VL_IDS)
    if kind == "qwen2_5_vl":
        # window_size 112 px = 4 merged units a side: images over 8 patches a side are cut
        # into several windows; block 1 of 3 attends over the whole image.
        return transformers.Qwen2_5_VLConfig(
            text_config=dict(TEXT, rope_scaling=MROPE), tie_word_embeddings=tied,
            vision_config=dict(depth=3, hidden_size=32, out_hidden_size=64, num_heads=2,
                               intermediate_size=48, fullatt_block_indexes=[1]), **VL_IDS)
    if kind == "llama":
        return transformers.LlamaConfig(**TEXT, rope_theta=100000.0, tie_word_embeddings=tied)
    if kind == "llama3":  # Llama 3.1's frequency rescaling, short original context
        return transformers.LlamaConfig(**TEXT, tie_word_embeddings=tied, rope_parameters={
            "rope_type": "llama3", "rope_theta": 100000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if kind == "qwen2":
        return transformers.Qwen2Config(**TEXT, tie_word_embeddings=tied)
    raise ValueError(kind)


def reference(kind: str, tied: bool = False, seed: int = 3,
              **overrides: object) -> transformers.PreTrainedModel:
    """The transformers model of ``kind`` with seeded variance-preserving weights (seed 3:
    greedy output of every kind varies over the tests' prompts, checked by each test)."""
    cfg = config(kind, tied)
    for key, value in overrides.items():
        setattr(cfg.get_text_config(), key, value)
    cls = {"qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
           "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
           "llama": transformers.LlamaForCausalLM,
           "llama3": transformers.LlamaForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM}[kind]
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name:
                p.normal_(0, 1)
            elif p.dim() > 1:  # Linear (out, in); the Conv3d patch embed (out, C, T, P, P)
                p.normal_(0, p[0].numel() ** -0.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
            else:  # norm scales
                p.normal_(1, 0.1)
    model.generation_config.eos_token_id = None  # compare MAX_NEW tokens, never stop early
    return model


def save(model: transformers.PreTrainedModel, out: Path, **kwargs: object) -> Path:
    model.save_pretrained(out, **kwargs)
    return out


def images(sizes: Sequence[tuple[int, int]], seed: int = 0,
           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(pixel_values, image_grid_thw) of random RGB images of (width, height) pixels."""
    processor = Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 160)
    rng = np.random.default_rng(seed)
    out = []
    for w, h in sizes:
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        batch = processor(images=[image], return_tensors="pt")
        out.append((batch["pixel_values"], batch["image_grid_thw"]))
    return out


def vl_prompt(texts: Sequence[list[int]], pictures: Sequence[tuple[torch.Tensor, torch.Tensor]],
              merge: int = 2) -> tuple[list[int], list[MultiModalFeatureSpec]]:
    """texts[0] + image 0 + texts[1] + ...: each image as vision_start, its image_pad run
    (what the feature covers) and vision_end."""
    assert len(texts) == len(pictures) + 1
    tokens, features = list(texts[0]), []
    for i, ((pixels, grid), text) in enumerate(zip(pictures, texts[1:], strict=True)):
        n = int(grid[0].prod()) // merge**2
        tokens.append(VISION_START)
        item = MultiModalKwargsItem({PIXEL_VALUES: FieldElem(pixels),
                                     IMAGE_GRID_THW: FieldElem(grid, keep_on_cpu=True)})
        features.append(MultiModalFeatureSpec(f"img-{i}", "image",
                                              PlaceholderRange(len(tokens), n), item))
        tokens.extend([IMAGE_PAD] * n + [VISION_END, *text])
    return tokens, features


def hf_inputs(tokens: list[int], pictures: Sequence[tuple[torch.Tensor, torch.Tensor]],
              ) -> dict[str, torch.Tensor]:
    """What the processor would hand transformers' model for ``tokens`` and ``pictures``."""
    ids = torch.tensor([tokens])
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if pictures:
        out["pixel_values"] = torch.cat([p for p, _ in pictures])
        out["image_grid_thw"] = torch.cat([g for _, g in pictures])
        out["mm_token_type_ids"] = (ids == IMAGE_PAD).int()
    return out
