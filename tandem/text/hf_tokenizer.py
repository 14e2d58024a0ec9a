""":class:`~tandem.text.tokenizer.Tokenizer` over a Hugging Face model directory's tokenizer files.

Files read: ``tokenizer.json`` (required: the ``tokenizers`` library runs it as is),
``tokenizer_config.json``, ``generation_config.json`` and ``config.json`` (optional), and
the chat template (:mod:`tandem.text.chat_template`). What transformers 5 does with them,
and so what this does (facts from its source, the code is ours):

* ``add_special_tokens`` adds what ``tokenizer.json``'s post-processor adds (Llama 3's
  BOS; nothing for Qwen2 and SmolLM2). With a ``tokenizer.json`` present, transformers 5
  ignores ``add_bos_token``/``add_eos_token`` in ``tokenizer_config.json``, so this does.
* ``added_tokens_decoder`` in ``tokenizer_config.json`` is applied on top of
  ``tokenizer.json``'s added tokens (it may mark a token special); an entry whose id does
  not match is an error here, where transformers would silently renumber.
* Decoding skips special tokens through the library; ``clean_up_tokenization_spaces``
  is ignored for BPE models as transformers 5 does (and refused for others, which this
  does not stream).

Special ids: BOS is ``bos_token`` of ``tokenizer_config.json`` (None if unset); the EOS
ids and the image placeholder ids are those of the config files, read as the workers read
them (``tandem.checkpoint_ids``: Qwen2-VL's defaults included), the EOS ids falling back to
the tokenizer's ``eos_token`` when the config files name none; PAD is ``pad_token``, else
``pad_token_id`` of the generation config. The image placeholder ``image_token_id`` is
wrapped in ``vision_start_token_id``/``vision_end_token_id`` when there are such ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from tandem.checkpoint_ids import CheckpointIds, checkpoint_ids, id_list
from tandem.errors import InvalidInput
from tandem.text.chat_template import ChatMessage, ChatTemplate, load_chat_template
from tandem.text.detokenizer import IncrementalDecoder, StreamDecoder
from tandem.text.model_files import BAD_MODEL, bad_key, read_json
from tandem.text.tokenizer import ImageTokens, SpecialTokens

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CONFIG_FILE = "config.json"
_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


class HFTokenizer:
    """A loaded model tokenizer; build it with :meth:`from_dir`."""

    def __init__(self, backend: tokenizers.Tokenizer, special: SpecialTokens,
                 image: ImageTokens | None, template: ChatTemplate | None,
                 model_dir: Path) -> None:
        self._backend = backend
        self._special = special
        self._image = image
        self._template = template
        self._model_dir = model_dir
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self._added_text = {i: tok.content for i, tok in added.items()}
        self._piece_bytes = _piece_decoder(backend)
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def special(self) -> SpecialTokens:
        return self._special

    @property
    def image(self) -> ImageTokens | None:
        return self._image

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added_text:  # added tokens are stored as plain text
            return self._added_text[token_id].encode()
        piece = self._backend.id_to_token(token_id)
        raw = None if piece is None else self._piece_bytes(piece)
        if raw is None:
            return self.decode([token_id], skip_special_tokens=False).encode()
        return raw

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def incremental_decoder(self) -> IncrementalDecoder:
        return StreamDecoder(self.decode, self._special_ids)

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._template

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        if self._template is None:
            raise InvalidInput(f"the model at {self._model_dir} has no chat template; send a "
                               "prompt instead of messages", "NO_CHAT_TEMPLATE")
        return self._template.render(messages, add_generation_prompt, tools)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> HFTokenizer:
        """Load and check every file; any problem is InvalidInput naming the file and key."""
        root = Path(model_dir)
        backend = _backend(root / TOKENIZER_FILE)
        config_path = root / TOKENIZER_CONFIG_FILE
        tok_config = read_json(config_path, required=False) or {}
        _apply_added_tokens(backend, tok_config, config_path)
        if (tok_config.get("clean_up_tokenization_spaces")
                and type(backend.model).__name__ != "BPE"):
            raise bad_key(config_path, "clean_up_tokenization_spaces",
                          "is true for a non-BPE tokenizer, which Tandem does not support")
        token_vars = _token_variables(tok_config, config_path)
        gen_config = read_json(root / GENERATION_CONFIG_FILE, required=False) or {}
        model_config = read_json(root / CONFIG_FILE, required=False) or {}

        def token_id(key: str) -> int | None:
            if key not in token_vars:
                return None
            tid = backend.token_to_id(token_vars[key])
            if tid is None:
                raise bad_key(config_path, key,
                              f"{token_vars[key]!r} is not in {TOKENIZER_FILE}'s vocabulary")
            return tid

        named = checkpoint_ids(model_config, root / CONFIG_FILE, gen_config,
                               root / GENERATION_CONFIG_FILE)  # as the workers read them
        eos_ids = named.eos
        if not eos_ids:
            eos = token_id("eos_token")
            if eos is None:
                raise bad_key(config_path, "eos_token",
                              f"missing, and no eos_token_id in {GENERATION_CONFIG_FILE} or "
                              f"{CONFIG_FILE}: the model has no end-of-sequence token")
            eos_ids = (eos,)
        pad_id = token_id("pad_token")
        if pad_id is None:
            pad = id_list(gen_config, "pad_token_id", root / GENERATION_CONFIG_FILE)
            pad_id = pad[0] if pad else None
        special = SpecialTokens(bos_id=token_id("bos_token"), eos_ids=eos_ids, pad_id=pad_id)
        vocab = backend.get_vocab_size(with_added_tokens=True)
        for name, ids in (("eos_token_id", special.eos_ids), ("pad_token_id", (pad_id,))):
            bad = [i for i in ids if i is not None and not 0 <= i < vocab]
            if bad:
                where = (root / GENERATION_CONFIG_FILE if name in gen_config
                         else root / CONFIG_FILE)
                raise bad_key(where, name, f"{bad} outside the tokenizer's {vocab} ids")
        image = _image_tokens(backend, named, root / CONFIG_FILE)
        template = load_chat_template(root, tok_config, token_vars)
        return cls(backend, special, image, template, root)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte (GPT-2's scheme, which Qwen, Llama 3 and
    SmolLM2 keep): printable Latin-1 bytes stand for themselves, the other bytes take the
    characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    chars = {chr(b): b for b in printable}
    chars.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return chars


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


def _piece_decoder(backend: tokenizers.Tokenizer) -> Callable[[str], bytes | None]:
    """A vocabulary piece -> the bytes it stands for, by the tokenizer's decoder: byte-level
    pieces map character by character, byte-fallback pieces (``<0xF0>``) are one byte;
    None = not such a piece (its bytes are then its decoded text's)."""
    state = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    kinds = {d.get("type") for d in state.get("decoders", [state])}

    def piece_bytes(piece: str) -> bytes | None:
        if "ByteLevel" in kinds and all(c in BYTE_LEVEL_ALPHABET for c in piece):
            return bytes(BYTE_LEVEL_ALPHABET[c] for c in piece)
        if "ByteFallback" in kinds and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return bytes((int(piece[3:5], 16),))
        return None

    return piece_bytes


def _backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise InvalidInput(f"{path}: file missing (Tandem reads the tokenizer from "
                           f"{TOKENIZER_FILE}; save the tokenizer with transformers to make one)",
                           BAD_MODEL)
    read_json(path, required=True)  # a JSON error with its line, before the library's own
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises a bare Exception for any bad content
        raise InvalidInput(f"{path}: not a tokenizer the tokenizers library can load ({exc})",
                           BAD_MODEL) from exc


def _apply_added_tokens(backend: tokenizers.Tokenizer, config: Mapping[str, Any],
                        path: Path) -> None:
    """``added_tokens_decoder`` on top of tokenizer.json, as transformers applies it."""
    entries = config.get("added_tokens_decoder") or {}
    if not isinstance(entries, dict):
        raise bad_key(path, "added_tokens_decoder", "must be an object of id -> token")
    current = backend.get_added_tokens_decoder()
    for key, entry in sorted(entries.items(), key=lambda kv: _int_key(path, kv[0])):
        tid = _int_key(path, key)
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise bad_key(path, f"added_tokens_decoder.{key}", "must have a string 'content'")
        flags = {f: bool(entry[f]) for f in _ADDED_TOKEN_FLAGS if f in entry}
        token = tokenizers.AddedToken(entry["content"], **flags)
        known = current.get(tid)
        if known is not None and repr(known) == repr(token):
            continue
        backend.add_tokens([token])
        if backend.token_to_id(entry["content"]) != tid:
            raise bad_key(path, f"added_tokens_decoder.{key}",
                          f"{entry['content']!r} has id {backend.token_to_id(entry['content'])} "
                          f"in {TOKENIZER_FILE}")


def _int_key(path: Path, key: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise bad_key(path, f"added_tokens_decoder.{key}", "is not an integer id") from None


def _token_variables(config: Mapping[str, Any], path: Path) -> dict[str, str]:
    """Every named token (``bos_token``, ``image_token``...): the chat template's variables."""
    named: dict[str, Any] = {k: v for k, v in config.items() if k.endswith("_token")}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        named.update(extra)
    out: dict[str, str] = {}
    for key, value in named.items():
        if isinstance(value, dict):
            value = value.get("content")
            if not isinstance(value, str):
                raise bad_key(path, key, "must be a string or a token with a string 'content'")
        if isinstance(value, str):
            out[key] = value
    return out


def _image_tokens(backend: tokenizers.Tokenizer, ids: CheckpointIds,
                  path: Path) -> ImageTokens | None:
    """The placeholder, its marker text wrapped in the vision start and end tokens."""
    if ids.image is None:
        return None
    texts = {}
    for key, tid in (("image_token_id", ids.image), ("vision_start_token_id", ids.vision_start),
                     ("vision_end_token_id", ids.vision_end)):
        if tid is None:
            continue
        texts[key] = backend.id_to_token(tid)
        if texts[key] is None:
            raise bad_key(path, key, f"{tid} is not in {TOKENIZER_FILE}'s vocabulary")
    marker = "".join(texts.get(k, "") for k in ("vision_start_token_id", "image_token_id",
                                                "vision_end_token_id"))
    return ImageTokens(marker=marker, pad_id=ids.image)
