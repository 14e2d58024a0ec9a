"""Text for the scheduler: tokenizers, chat templates and streaming detokenization.

Entry point: :func:`load_tokenizer` (a model directory or a built-in preset name) gives a
:class:`Tokenizer`; see :mod:`tandem.text.tokenizer` for the interface and the image
placeholder rule.
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem.errors import InvalidInput
from tandem.text.byte_tokenizer import ByteTokenizer
from tandem.text.chat_template import ChatMessage, ContentPart, ImagePart, TextPart, ToolCall
from tandem.text.detokenizer import IncrementalDecoder, StreamDecoder
from tandem.text.hf_tokenizer import CONFIG_FILE, TOKENIZER_FILE, HFTokenizer
from tandem.text.model_files import BAD_MODEL
from tandem.text.tokenizer import (
    ImageTokens,
    SpecialTokens,
    Tokenizer,
    encode_chat,
    expand_images,
)

__all__ = [
    "ByteTokenizer", "ChatMessage", "ContentPart", "HFTokenizer", "ImagePart", "ImageTokens",
    "IncrementalDecoder", "SpecialTokens", "StreamDecoder", "TextPart", "Tokenizer", "ToolCall",
    "encode_chat", "expand_images", "load_tokenizer",
]


def load_tokenizer(model_dir_or_preset: str | Path) -> Tokenizer:
    """The tokenizer of ``--model``: a Hugging Face directory, or the byte tokenizer.

    A directory with ``tokenizer.json`` is a Hugging Face model. A directory without
    one is accepted only as Tandem's own export (a ``config.json`` with no
    ``model_type``), which uses the built-in byte vocabulary. Anything that is not a
    directory is a preset name (the workers check the name); a name that looks like a
    path but is no directory is refused rather than served with the wrong tokenizer.
    """
    path = Path(model_dir_or_preset)
    if not path.is_dir():
        text = str(model_dir_or_preset)
        if "/" in text or text.startswith((".", "~")):
            raise InvalidInput(f"model directory {text} does not exist", BAD_MODEL)
        return ByteTokenizer()
    if (path / TOKENIZER_FILE).is_file():
        return HFTokenizer.from_dir(path)
    config = path / CONFIG_FILE
    try:
        is_hf = config.is_file() and "model_type" in json.loads(config.read_text("utf-8"))
    except (OSError, ValueError):
        is_hf = True  # unreadable: let the error below name the missing tokenizer
    if is_hf or not config.is_file():
        raise InvalidInput(f"{path / TOKENIZER_FILE}: file missing (a Hugging Face model "
                           "directory needs its tokenizer)", BAD_MODEL)
    return ByteTokenizer()
