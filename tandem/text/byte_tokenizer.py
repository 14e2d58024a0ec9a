""":class:`~tandem.text.tokenizer.Tokenizer` of the built-in presets: UTF-8 bytes plus four ids.

Token ids 0..255 are the UTF-8 bytes themselves; the special tokens follow (the built-in
models' embedding tables are sized from ``VOCAB_SIZE``). The literal text ``<image>`` in a
prompt is not tokenized as bytes: it becomes one IMAGE placeholder, which the scheduler
then expands to the image's embedding count. The presets also get a small chat template,
so ``messages`` requests work on them too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tandem.text.chat_template import ChatMessage, ChatTemplate
from tandem.text.detokenizer import IncrementalDecoder, StreamDecoder
from tandem.text.tokenizer import ImageTokens, SpecialTokens

NUM_BYTE_TOKENS = 256
PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
IMAGE_ID = 259
VOCAB_SIZE = 260
IMAGE_MARKER = "<image>"

# One line per message, "role: content", images as the <image> marker.
BUILTIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: "
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
_NAMES = {PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>",
          IMAGE_ID: IMAGE_MARKER}


class ByteTokenizer:
    vocab_size = VOCAB_SIZE
    special = SpecialTokens(bos_id=BOS_ID, eos_ids=(EOS_ID,),
                            pad_id=PAD_ID)
    image: ImageTokens | None = ImageTokens(IMAGE_MARKER, IMAGE_ID)

    def __init__(self) -> None:
        self._template = ChatTemplate(BUILTIN_CHAT_TEMPLATE, {}, "built-in chat template")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [BOS_ID] if add_special_tokens else []
        for i, piece in enumerate(text.split(IMAGE_MARKER)):
            if i:
                ids.append(IMAGE_ID)
            ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return bytes(t for t in ids if 0 <= t < NUM_BYTE_TOKENS).decode(
                "utf-8", "replace")
        out: list[str] = []
        run = bytearray()
        for t in ids:
            if 0 <= t < NUM_BYTE_TOKENS:
                run.append(t)
            elif t in _NAMES:
                out.append(run.decode("utf-8", "replace"))
                run.clear()
                out.append(_NAMES[t])
        out.append(run.decode("utf-8", "replace"))
        return "".join(out)

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < NUM_BYTE_TOKENS:
            return bytes((token_id,))
        return _NAMES.get(token_id, "").encode()

    def is_special(self, token_id: int) -> bool:
        return token_id in _NAMES

    def incremental_decoder(self) -> IncrementalDecoder:
        return StreamDecoder(self.decode, _NAMES.keys())

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._template

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        return self._template.render(messages, add_generation_prompt, tools)
