"""Chat templates render exactly as transformers' apply_chat_template, in a sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tandem.errors import InvalidInput
from tandem.text import ChatMessage, ImagePart, TextPart, encode_chat, load_tokenizer
from tandem.text.chat_template import ChatTemplate, template_data
from tandem_testing.text_checkpoints import (
    llama3_style_dir,
    qwen2_vl_dir,
    reference_tokenizer,
    smollm2_dir,
)


def _msg(role: str, *parts: str | None) -> ChatMessage:
    """A message; ``None`` stands for an image."""
    return ChatMessage(role, tuple(ImagePart() if p is None else TextPart(p) for p in parts))


TEXT_CONVERSATIONS = [
    [_msg("user", "What is the capital of France?")],
    [_msg("system", "Be brief."), _msg("user", "Hi"), _msg("assistant", "Hello! 你好"),
     _msg("user", "  Again?  ")],
    [_msg("user", "Write code:", " ```py\nprint('x')\n```")],  # two text parts
]
IMAGE_CONVERSATIONS = [
    [_msg("user", None, "Describe this image.")],
    [_msg("system", "You see images."), _msg("user", "Compare ", None, " and ", None, ".")],
    [_msg("user", None), _msg("assistant", "A cat."), _msg("user", "And this?", None)],
]


@pytest.mark.parametrize("make_dir", [qwen2_vl_dir, llama3_style_dir, smollm2_dir])
@pytest.mark.parametrize("conversation", TEXT_CONVERSATIONS)
def test_text_chat_renders_and_tokenizes_like_transformers(make_dir, conversation) -> None:
    ours, ref = load_tokenizer(make_dir()), reference_tokenizer(make_dir())
    data = template_data(conversation)
    assert ours.render_chat(conversation) == ref.apply_chat_template(
        data, add_generation_prompt=True, tokenize=False)
    assert encode_chat(ours, conversation) == ref.apply_chat_template(
        data, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.render_chat(conversation, add_generation_prompt=False) == (
        ref.apply_chat_template(data, add_generation_prompt=False, tokenize=False))


@pytest.mark.parametrize("conversation", IMAGE_CONVERSATIONS)
def test_qwen2_vl_image_chat_renders_like_transformers(conversation) -> None:
    ours, ref = load_tokenizer(qwen2_vl_dir()), reference_tokenizer(qwen2_vl_dir())
    data = template_data(conversation)
    text = ours.render_chat(conversation)
    assert text == ref.apply_chat_template(data, add_generation_prompt=True, tokenize=False)
    images = sum(isinstance(p, ImagePart) for m in conversation for p in m.content)
    assert ours.image is not None and text.count(ours.image.marker) == images
    assert encode_chat(ours, conversation).count(ours.image.pad_id) == images


def test_text_only_template_refuses_images_as_transformers_fails() -> None:
    conversation = IMAGE_CONVERSATIONS[0]
    with pytest.raises(TypeError):  # SmolLM2's template concatenates content as a string
        reference_tokenizer(smollm2_dir()).apply_chat_template(
            template_data(conversation), add_generation_prompt=True, tokenize=False)
    with pytest.raises(InvalidInput, match="chat template failed on this conversation") as info:
        load_tokenizer(smollm2_dir()).render_chat(conversation)
    assert info.value.reason == "BAD_CHAT"


def test_raise_exception_becomes_invalid_input_with_the_templates_message() -> None:
    bad_order = [_msg("assistant", "first"), _msg("user", "then")]
    with pytest.raises(InvalidInput, match="Conversation roles must alternate"):
        load_tokenizer(llama3_style_dir()).render_chat(bad_order)
    with pytest.raises(InvalidInput, match="no messages"):
        load_tokenizer(llama3_style_dir()).render_chat([])


# --- environment features, each against transformers rendering the same template ---

@pytest.fixture(scope="module")
def tiny_ref(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-tok")
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate("abc")}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<img>")])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "image_token": "<img>"}))
    return directory, reference_tokenizer(directory)


FEATURE_TEMPLATES = {
    "tojson": "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}"
              "|{{ {'é': 1} | tojson(ensure_ascii=True) }}|{{ {'b': 1, 'a': 2} | tojson("
              "sort_keys=True, separators=(',', ':')) }}",
    "loopcontrols": "{% for m in messages %}{% if loop.index == 2 %}{% continue %}{% endif %}"
                    "{{ m.role }};{% if loop.index == 3 %}{% break %}{% endif %}{% endfor %}",
    "whitespace": "{% for m in messages %}\n    {{ m.role }}\n{% endfor %}\n  {%- if true %} x\n"
                  "{% endif %}",
    "tokens": "{{ bos_token }}{{ eos_token }}{{ image_token }}{{ pad_token is defined }}",
    "generation": "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}"
                  "{% endfor %}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                 "{% endfor %}{{ ns.n }}",
    "strftime": "{{ strftime_now('%Y') | length }}",
    "prompt": "{{ messages | length }}{% if add_generation_prompt %}<go>{% endif %}",
}


@pytest.mark.parametrize("name", sorted(FEATURE_TEMPLATES))
def test_environment_features_match_transformers(tiny_ref, name: str) -> None:
    directory, ref = tiny_ref
    source = FEATURE_TEMPLATES[name]
    conversation = TEXT_CONVERSATIONS[1]
    ours = ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>", "image_token": "<img>"},
                        "test").render(conversation)
    assert ours == ref.apply_chat_template(template_data(conversation), chat_template=source,
                                           add_generation_prompt=True, tokenize=False)
    # The loader gives templates the same token variables transformers does.
    (directory / "chat_template.jinja").write_text(source)
    try:
        assert load_tokenizer(directory).render_chat(conversation) == ours
    finally:
        (directory / "chat_template.jinja").unlink()


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.append(1) }}",  # immutable sandbox: no mutating calls
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ cycler.__init__.__globals__ }}",
])
def test_sandbox_refuses_unsafe_templates(source: str) -> None:
    with pytest.raises(InvalidInput, match="refused the conversation") as info:
        ChatTemplate(source, {}, "test").render(TEXT_CONVERSATIONS[0])
    assert info.value.reason == "BAD_CHAT"


def _dir_with_templates(tmp_path: Path, *, jinja: str | None, legacy: str | None,
                        config: object) -> Path:
    tok = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg: dict[str, object] = {"eos_token": "</s>"}
    if config is not None:
        cfg["chat_template"] = config
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    if legacy is not None:
        (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": legacy}))
    return tmp_path


@pytest.mark.parametrize(("jinja", "legacy", "config", "expected"), [
    ("jinja", "json", "config", "jinja"),
    (None, "json", "config", "json"),
    (None, None, "config", "config"),
    (None, None, [{"name": "tool_use", "template": "tools"},
                  {"name": "default", "template": "listed"}], "listed"),
])
def test_template_lookup_order(tmp_path, jinja, legacy, config, expected) -> None:
    directory = _dir_with_templates(tmp_path, jinja=jinja, legacy=legacy, config=config)
    assert load_tokenizer(directory).render_chat(TEXT_CONVERSATIONS[0]) == expected


def test_no_template_is_a_clear_error(tmp_path) -> None:
    directory = _dir_with_templates(tmp_path, jinja=None, legacy=None, config=None)
    with pytest.raises(InvalidInput, match="has no chat template; send a prompt") as info:
        load_tokenizer(directory).render_chat(TEXT_CONVERSATIONS[0])
    assert info.value.reason == "NO_CHAT_TEMPLATE"


def test_builtin_presets_have_a_chat_template_with_image_markers() -> None:
    tok = load_tokenizer("tiny")
    conversation = [_msg("system", "Be brief."), _msg("user", "Look: ", None, " ok?")]
    text = tok.render_chat(conversation)
    assert text == "system: Be brief.\nuser: Look: <image> ok?\nassistant: "
    ids = encode_chat(tok, conversation)
    assert tok.image is not None and ids.count(tok.image.pad_id) == 1
    assert ids[0] != tok.special.bos_id  # a rendered chat is encoded without added specials
