"""The tokenizer interface the scheduler uses, whatever the model.

Two implementations: :class:`~tandem.text.hf_tokenizer.HFTokenizer` over a Hugging Face
``tokenizer.json``, and :class:`~tandem.text.byte_tokenizer.ByteTokenizer` for the
built-in presets. No caller hard-codes a special id: BOS, the EOS ids, PAD and the image
placeholder come from here.

Images in token ids. A prompt writes one *marker* per image (built-in models:
``<image>``; Qwen2-VL: ``<|vision_start|><|image_pad|><|vision_end|>``, as Hugging Face
prompts do). The marker encodes to exactly one ``pad_id`` (plus, for Qwen, the start and
end tokens around it), and :func:`expand_images` repeats each ``pad_id`` once per image
embedding::

    marker ids:    ... <|vision_start|> <|image_pad|>            <|vision_end|> ...
    expanded ids:  ... <|vision_start|> <|image_pad|> x N        <|vision_end|> ...
                                        ^ span (offset, N): the image feature's placeholders
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.errors import InvalidInput
from tandem.text.chat_template import ChatMessage, ChatTemplate
from tandem.text.detokenizer import IncrementalDecoder


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """The ids a server needs, from the model's files (see each implementation for where)."""

    bos_id: int | None  # None: the model has no BOS
    eos_ids: tuple[int, ...]  # generation stops at any of them; never empty
    pad_id: int | None


@dataclass(frozen=True, slots=True)
class ImageTokens:
    """How an image appears in a prompt and in token ids (see the module docstring)."""

    marker: str  # the prompt text for one image
    pad_id: int  # the placeholder id; one per image in the encoded marker


class Tokenizer(Protocol):
    """Text <-> ids, the special ids, and the model's chat template."""

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce are ``0 .. vocab_size - 1``."""
        ...

    @property
    def special(self) -> SpecialTokens: ...

    @property
    def image(self) -> ImageTokens | None:
        """None for a text-only model."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``; special tokens written in it are parsed as special tokens.

        ``add_special_tokens`` adds what the model adds around a plain prompt (e.g.
        Llama's BOS); a rendered chat template already holds them, so chat prompts are
        encoded without (as transformers' ``apply_chat_template`` does).
        """
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for, which may be part of a character's UTF-8 (a
        special token's: its text's). The logprobs' ``bytes``: decoding one such token
        alone would show U+FFFD instead."""
        ...

    def is_special(self, token_id: int) -> bool:
        """Whether decoding with ``skip_special_tokens`` drops ``token_id``."""
        ...

    def incremental_decoder(self) -> IncrementalDecoder:
        """A fresh streaming decoder (special tokens skipped) for one request's output."""
        ...

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The model's chat template (None: it has none)."""
        ...

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text of a conversation, from the model's chat template; ``tools`` as
        transformers' ``apply_chat_template`` takes them (OpenAI's ``tools`` list)."""
        ...


def encode_chat(tokenizer: Tokenizer, messages: Sequence[ChatMessage],
                tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """A conversation's prompt ids, ready for the assistant's turn."""
    return tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=True,
                                                  tools=tools), add_special_tokens=False)


def expand_images(token_ids: Sequence[int], image: ImageTokens | None,
                  num_tokens: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Repeat the i-th image placeholder ``num_tokens[i]`` times.

    Returns the expanded ids and each image's placeholder span ``(offset, length)`` in
    them. A placeholder count that differs from the number of images is InvalidInput.
    """
    if image is None:
        if num_tokens:
            raise InvalidInput(f"{len(num_tokens)} images were sent but this model takes no "
                               "images", "IMAGE_COUNT_MISMATCH")
        return list(token_ids), []
    found = sum(1 for t in token_ids if t == image.pad_id)
    if found != len(num_tokens):
        raise InvalidInput(f"the prompt has {found} image placeholders ({image.marker}) but "
                           f"{len(num_tokens)} images were sent", "IMAGE_COUNT_MISMATCH")
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    for t in token_ids:
        if t != image.pad_id:
            out.append(t)
            continue
        n = num_tokens[len(spans)]
        spans.append((len(out), n))
        out.extend([t] * n)
    return out, spans
