"""Tokenizers behind tandem.text's interface: real vocabularies against transformers, the
special ids, image placeholders, the byte tokenizer, and load errors naming file and key."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from tandem.errors import InvalidInput
from tandem.text import ByteTokenizer, HFTokenizer, expand_images, load_tokenizer
from tandem.text import byte_tokenizer as byte_vocab
from tandem_testing.text_checkpoints import (
    QWEN_FIRST_SPECIAL_ID,
    llama3_style_dir,
    qwen2_vl_dir,
    reference_tokenizer,
    smollm2_dir,
)
from worker_svc.hf_config import hf_config_fields

MIXED_TEXTS = [
    "Hello, world! What's the capital of France?",
    "你好，世界！这是一个测试。日本語のテキストも。한국어 문장.",  # noqa: RUF001 (CJK punctuation)
    "emoji 🤖🎉 👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "def f(x):\n    return x**2  # square\n\n\tindent\r\nCRLF {\"json\": [1, 2.5e-3]}",
    "<|im_start|>user\nhi<|im_end|>\n<|vision_start|><|image_pad|><|vision_end|>",
    "combining: e\u0301 vs é, Ångström, ﬁ ligature, ½",
    "   leading and trailing spaces   ",
    "numbers 1234567890 and 3.14159",
    "",
]
DIRS = {"qwen2-vl": qwen2_vl_dir, "llama3-style": llama3_style_dir, "smollm2": smollm2_dir}


@pytest.fixture(scope="module", params=sorted(DIRS))
def pair(request):
    """(Tandem's tokenizer, transformers' tokenizer) loaded from the same directory."""
    directory = DIRS[request.param]()
    return load_tokenizer(directory), reference_tokenizer(directory)


@pytest.mark.parametrize("text", MIXED_TEXTS)
def test_encode_and_decode_match_transformers(pair, text: str) -> None:
    ours, ref = pair
    for add in (True, False):
        ids = ours.encode(text, add_special_tokens=add)
        assert ids == ref.encode(text, add_special_tokens=add)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip)


def test_vocab_size_matches_transformers(pair) -> None:
    ours, ref = pair
    assert ours.vocab_size == len(ref)


def test_qwen2_vl_special_ids_come_from_the_model_files() -> None:
    tok = load_tokenizer(qwen2_vl_dir())
    ref = reference_tokenizer(qwen2_vl_dir())
    assert isinstance(tok, HFTokenizer)
    assert tok.special.bos_id is None  # Qwen has no BOS
    assert tok.special.eos_ids == (151645, 151643)  # generation_config.json: a list
    assert tok.special.pad_id == ref.pad_token_id == 151643
    assert tok.image is not None
    assert tok.image.pad_id == ref.convert_tokens_to_ids("<|image_pad|>") == 151655
    assert tok.image.marker == "<|vision_start|><|image_pad|><|vision_end|>"
    assert ref.convert_tokens_to_ids("<|endoftext|>") == QWEN_FIRST_SPECIAL_ID


def test_llama_adds_bos_and_smollm2_does_not() -> None:
    llama = load_tokenizer(llama3_style_dir())
    assert llama.special.bos_id is not None
    assert llama.encode("hi")[0] == llama.special.bos_id
    assert llama.encode("hi", add_special_tokens=False)[0] != llama.special.bos_id
    assert llama.image is None  # text-only: no image_token_id in config.json
    smol = load_tokenizer(smollm2_dir())
    assert smol.special.bos_id == 1 and smol.special.eos_ids == (2,)
    assert smol.encode("hi") == smol.encode("hi", add_special_tokens=False)


def test_image_marker_expands_like_the_hf_processor() -> None:
    """Qwen's processor repeats <|image_pad|> N times in the text, then tokenizes."""
    tok = load_tokenizer(qwen2_vl_dir())
    ref = reference_tokenizer(qwen2_vl_dir())
    assert tok.image is not None
    marker = tok.image.marker
    prompt = f"Compare {marker} and {marker}."
    ids, spans = expand_images(tok.encode(prompt), tok.image, [4, 6])
    expected = ref.encode(prompt.replace("<|image_pad|>", "<|image_pad|>" * 4, 1)
                          .replace(f"{marker}.", marker.replace("<|image_pad|>",
                                                                "<|image_pad|>" * 6) + "."))
    assert ids == expected
    for (offset, length), n in zip(spans, (4, 6), strict=True):
        assert length == n and ids[offset:offset + n] == [tok.image.pad_id] * n
        assert ids[offset - 1] == ref.convert_tokens_to_ids("<|vision_start|>")
        assert ids[offset + n] == ref.convert_tokens_to_ids("<|vision_end|>")


def test_placeholder_count_must_match_images() -> None:
    tok = load_tokenizer(qwen2_vl_dir())
    assert tok.image is not None
    with pytest.raises(InvalidInput, match=r"2 image placeholders .* but 1 images") as info:
        expand_images(tok.encode(tok.image.marker * 2), tok.image, [4])
    assert info.value.reason == "IMAGE_COUNT_MISMATCH"
    with pytest.raises(InvalidInput, match="takes no images"):
        expand_images([1, 2], None, [4])
    assert expand_images([1, 2], None, []) == ([1, 2], [])


def test_byte_tokenizer_behind_the_interface() -> None:
    tok = load_tokenizer("tiny")
    assert isinstance(tok, ByteTokenizer)
    assert tok.vocab_size == byte_vocab.VOCAB_SIZE
    assert tok.special.bos_id == byte_vocab.BOS_ID and tok.special.eos_ids == (byte_vocab.EOS_ID,)
    assert tok.image is not None and tok.image.marker == "<image>"
    ids = tok.encode("hé <image>!")
    # The built-in models' ids: BOS, UTF-8 bytes, one IMAGE id per <image>.
    assert ids == [byte_vocab.BOS_ID, *"hé ".encode(), byte_vocab.IMAGE_ID, ord("!")]
    assert tok.encode("x", add_special_tokens=False) == [ord("x")]
    expanded, spans = expand_images(ids, tok.image, [3])
    assert spans == [(5, 3)] and expanded[5:8] == [byte_vocab.IMAGE_ID] * 3
    assert tok.decode(ids) == "hé !"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>hé <image>!"


def test_tandem_export_directory_uses_the_byte_tokenizer(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"dim": 64, "n_layers": 2}))
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)


# --- load errors: a small tokenizer.json written here, one broken file at a time ---

def _tiny_dir(tmp_path: Path) -> Path:
    tok = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate("abcdeh")},
                                          merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])  # id 6
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return tmp_path


def test_tiny_directory_loads(tmp_path) -> None:
    tok = load_tokenizer(_tiny_dir(tmp_path))
    assert tok.special.eos_ids == (6,) and tok.special.bos_id is None
    assert tok.encode("abc") == [0, 1, 2] and tok.image is None


@pytest.mark.parametrize(
    ("file", "content", "match"),
    [
        ("tokenizer.json", None, "tokenizer.json: file missing"),
        ("tokenizer.json", '{"model": ', "tokenizer.json: not valid JSON .* line 1"),
        ("tokenizer.json", '{"model": {"type": "Nope"}}', "tokenizers library can load"),
        ("tokenizer_config.json", "[1, 2]", "expected a JSON object, got list"),
        ("tokenizer_config.json", '{"eos_token": "<nope>"}',
         "tokenizer_config.json: eos_token '<nope>' is not in tokenizer.json"),
        ("tokenizer_config.json", '{"bos_token": {"content": 3}}', "bos_token must be"),
        ("tokenizer_config.json", '{"added_tokens_decoder": {"9": {"content": "<eos>"}}}',
         r"added_tokens_decoder.9 '<eos>' has id 6"),
        ("tokenizer_config.json", '{"added_tokens_decoder": {"x": {"content": "<q>"}}}',
         "added_tokens_decoder.x is not an integer id"),
        ("tokenizer_config.json", "{}", "eos_token missing, .* no end-of-sequence token"),
        ("tokenizer_config.json", '{"eos_token": "<eos>", "chat_template": "{% if %}"}',
         "chat_template: chat template does not parse"),
        ("tokenizer_config.json",
         '{"eos_token": "<eos>", "chat_template": [{"name": "tool_use", "template": "x"}]}',
         "lists templates .* none named 'default'"),
        ("generation_config.json", '{"eos_token_id": "2"}',
         "generation_config.json: eos_token_id must be an integer"),
        ("generation_config.json", '{"eos_token_id": [6, 99]}', r"eos_token_id \[99\] outside"),
        ("chat_template.json", '{"chat_template": 5}', "chat_template.json: chat_template must"),
        ("chat_template.jinja", "{% for %}", "chat_template.jinja: chat template does not"),
        ("config.json", '{"model_type": "qwen2_vl", "image_token_id": 999}',
         "config.json: image_token_id 999 is not in tokenizer.json"),
    ],
)
def test_bad_directory_is_invalid_input_naming_file_and_key(tmp_path, file, content, match):
    directory = _tiny_dir(tmp_path)
    if content is None:
        (directory / file).unlink()
        (directory / "config.json").write_text('{"model_type": "llama"}')
    else:
        (directory / file).write_text(content)
    with pytest.raises(InvalidInput, match=match) as info:
        load_tokenizer(directory)
    assert str(directory / file) in info.value.message
    assert info.value.reason == "BAD_MODEL"


def test_missing_directory_is_not_mistaken_for_a_preset(tmp_path) -> None:
    with pytest.raises(InvalidInput, match="does not exist"):
        load_tokenizer(tmp_path / "no-such-model")
    with pytest.raises(InvalidInput, match="does not exist"):
        load_tokenizer("./models/typo")


def test_added_tokens_decoder_can_mark_a_token_special(tmp_path) -> None:
    """As transformers applies tokenizer_config.json on top of tokenizer.json."""
    directory = _tiny_dir(tmp_path)
    cfg = {"eos_token": "<eos>", "added_tokens_decoder": {
        "7": {"content": "<tool>", "special": True, "normalized": False}}}
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(directory)
    ids = tok.encode("a<tool>b")
    assert ids == [0, 7, 1]
    assert tok.decode(ids) == "ab" and tok.decode(ids, skip_special_tokens=False) == "a<tool>b"
    ref = reference_tokenizer(directory)
    assert ref.encode("a<tool>b") == ids and ref.decode(ids, skip_special_tokens=True) == "ab"


def test_real_checkpoint_layout_copied_elsewhere_still_loads(tmp_path) -> None:
    """Only the directory's own files count (no hub, no cache): a copy behaves the same."""
    src = qwen2_vl_dir()
    for name in os.listdir(src):
        shutil.copy(src / name, tmp_path / name)
    assert load_tokenizer(tmp_path).encode(MIXED_TEXTS[1]) == load_tokenizer(src).encode(
        MIXED_TEXTS[1])


def test_the_scheduler_and_the_workers_read_the_same_special_ids(tmp_path) -> None:
    """Issue 22, item 18: the tokenizer and the workers' config parsed the ids apart. A
    Qwen2-VL config.json without its vision ids (transformers' defaults apply) and with
    its EOS in text_config as well as at the top gave the tokenizer no image placeholder
    (so the scheduler refused the model: "placeholder id is None but ... 151655") and
    another EOS than the workers mask under min_tokens."""
    directory = tmp_path / "qwen2-vl"
    shutil.copytree(qwen2_vl_dir(), directory)
    (directory / "generation_config.json").unlink()
    text = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
            "intermediate_size": 128, "max_position_embeddings": 256, "vocab_size": 151936,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "eos_token_id": 151645}
    config = {"model_type": "qwen2_vl", "eos_token_id": 151643, "text_config": text,
              "vision_config": {"embed_dim": 32, "hidden_size": 64, "num_heads": 2}}
    (directory / "config.json").write_text(json.dumps(config))
    workers = hf_config_fields(directory / "config.json", config)
    tok = load_tokenizer(directory)
    assert tok.image is not None and tok.image.pad_id == workers["image_token_id"] == 151655
    assert tok.image.marker == "<|vision_start|><|image_pad|><|vision_end|>"
    assert tok.special.eos_ids == workers["eos_token_ids"] == (151645,)
